"""WML, the game's data language: a small preprocessor (#define/#enddef macros with #arg defaults, {MACRO args},
#ifdef treated as "not defined"), a tag/attribute parser, and image-path expansion (`x-[1~4,3].png`, `[a,b]`,
`*n`)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

MAX_MACRO_DEPTH = 25

DIRECTIVES = (
    "#define",
    "#enddef",
    "#arg",
    "#endarg",
    "#ifdef",
    "#ifndef",
    "#else",
    "#endif",
    "#textdomain",
    "#undef",
    "#ifver",
    "#ifhave",
    "#ifnhave",
    "#ifnver",
)
DEFINE_RE = re.compile(r"^\s*#define\s+(\S+)(.*)$")
ARG_RE = re.compile(r"^\s*#arg\s+(\S+)")
NAMED_ARG_RE = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$", re.S)


@dataclass(frozen=True)
class Macro:
    params: tuple[str, ...]
    defaults: dict[str, str]
    body: str


def strip_comment(line: str) -> str:
    """Remove a `#` comment outside double quotes; preprocessor directives are kept whole."""
    if line.lstrip().startswith(DIRECTIVES):
        return line
    quoted = False
    for i, c in enumerate(line):
        if c == '"':
            quoted = not quoted
        elif c == "#" and not quoted:
            return line[:i]
    return line


def collect_macros(text: str) -> dict[str, Macro]:
    """Every `#define NAME PARAMS ... #enddef` of a file, with `#arg NAME ... #endarg` defaults."""
    macros: dict[str, Macro] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = DEFINE_RE.match(lines[i])
        i += 1
        if not m:
            continue
        name, params = m.group(1), tuple(m.group(2).split("#")[0].split())
        body: list[str] = []
        defaults: dict[str, str] = {}
        while i < len(lines) and not lines[i].strip().startswith("#enddef"):
            line = lines[i]
            if "#enddef" in line:  # body text and #enddef on one line
                body.append(line.split("#enddef")[0])
                break
            am = ARG_RE.match(line)
            if am:
                value: list[str] = []
                i += 1
                while i < len(lines) and not lines[i].strip().startswith("#endarg"):
                    value.append(lines[i])
                    i += 1
                defaults[am.group(1)] = "\n".join(value)
            else:
                body.append(strip_comment(line))
            i += 1
        macros[name] = Macro(params, defaults, "\n".join(body))
        i += 1
    return macros


def remove_defines(text: str) -> str:
    return re.sub(r"(?ms)^\s*#define\b.*?#enddef[^\n]*$", "", text)


def drop_ifdefs(text: str) -> str:
    """Keep the branches taken when no preprocessor symbol is defined; drop every directive line."""
    out: list[str] = []
    stack: list[bool] = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith(("#ifdef", "#ifhave", "#ifver")):
            stack.append(False)
        elif s.startswith(("#ifndef", "#ifnhave", "#ifnver")):
            stack.append(True)
        elif s.startswith("#else") and stack:
            stack[-1] = not stack[-1]
        elif s.startswith("#endif") and stack:
            stack.pop()
        elif s.startswith("#"):
            continue
        elif all(stack):
            out.append(line)
    return "\n".join(out)


def _balanced_end(s: str, start: int) -> int:
    """Index of the `}` closing the `{` at `start` (or len(s) when unbalanced)."""
    depth = 0
    for k in range(start, len(s)):
        if s[k] == "{":
            depth += 1
        elif s[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(s)


def split_args(call: str) -> list[str]:
    """`NAME a (b c) "d e" {X y}` -> ['NAME', 'a', 'b c', '"d e"', '{X y}']."""
    args: list[str] = []
    cur: list[str] = []
    depth, quoted, i = 0, False, 0
    while i < len(call):
        c = call[i]
        if c == '"':
            quoted = not quoted
            cur.append(c)
        elif quoted:
            cur.append(c)
        elif c == "(":
            if depth > 0:
                cur.append(c)
            depth += 1
        elif c == ")":
            depth -= 1
            if depth > 0:
                cur.append(c)
            elif depth == 0:
                args.append("".join(cur))
                cur = []
        elif c == "{":
            end = _balanced_end(call, i)
            cur.append(call[i : end + 1])
            i = end
        elif c.isspace() and depth == 0:
            if cur:
                args.append("".join(cur))
                cur = []
        else:
            cur.append(c)
        i += 1
    if cur:
        args.append("".join(cur))
    return args


def expand(text: str, macros: dict[str, Macro], depth: int = 0) -> str:
    """Substitute `{MACRO args}` calls recursively; unknown macros and file includes are dropped."""
    if depth > MAX_MACRO_DEPTH:
        return text
    out: list[str] = []
    i = 0
    while (j := text.find("{", i)) >= 0:
        out.append(text[i:j])
        k = _balanced_end(text, j)
        i = k + 1
        parts = split_args(text[j + 1 : k])
        if not parts or parts[0] not in macros:
            continue
        macro = macros[parts[0]]
        env = dict(macro.defaults)
        positional: list[str] = []
        for arg in parts[1:]:
            m = NAMED_ARG_RE.match(arg)
            if m:
                env[m.group(1)] = m.group(2)
            else:
                positional.append(arg)
        env.update(zip(macro.params, positional))
        body = drop_ifdefs(macro.body)
        for name in sorted(env, key=len, reverse=True):
            body = body.replace("{" + name + "}", env[name])
        out.append(expand(body, macros, depth + 1))
    out.append(text[i:])
    return "".join(out)


@dataclass
class Node:
    tag: str
    attrs: dict[str, str] = field(default_factory=dict)
    children: list[Node] = field(default_factory=list)

    def kids(self, tag: str) -> list[Node]:
        return [c for c in self.children if c.tag == tag]

    def walk(self, parents: tuple[Node, ...] = ()) -> Iterator[tuple[Node, tuple[Node, ...]]]:
        yield self, parents
        for c in self.children:
            yield from c.walk(parents + (self,))


TAG_RE = re.compile(r"^\s*\[(/?)([+a-z_0-9]+)\]\s*$")
TAG_SPLIT_RE = re.compile(r"(\[/?[+a-z_0-9]+\])")


def clean_value(value: str) -> str:
    """A WML value without translation marks, quotes and `"a" + "b"` concatenation."""
    v = value.strip()
    v = re.sub(r'(^|[\s+])_\s*(?=")', r"\1", v)
    v = re.sub(r'"\s*\+\s*"', "", v)
    return v.replace('""', "\x00").replace('"', "").replace("\x00", '"').strip()


def parse_wml(text: str) -> Node:
    """Preprocessed WML -> a tree of tags with their attributes (later values of a key win)."""
    root = Node("root")
    stack = [root]
    lines = [strip_comment(line) for line in text.splitlines()]
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        for piece in TAG_SPLIT_RE.split(line):
            if not piece.strip():
                continue
            m = TAG_RE.match(piece)
            if m:
                if m.group(1):
                    if len(stack) > 1:
                        stack.pop()
                else:
                    node = Node(m.group(2).lstrip("+"))
                    stack[-1].children.append(node)
                    stack.append(node)
                continue
            if "=" not in piece:
                continue
            key, value = piece.split("=", 1)
            while value.count('"') % 2 == 1 and i < len(lines):  # a quoted value over several lines
                value += "\n" + lines[i]
                i += 1
            while value.rstrip().endswith("+") and i < len(lines):  # `"a" +` continued on the next line
                value = value.rstrip() + " " + lines[i].strip()
                i += 1
            stack[-1].attrs[key.strip()] = clean_value(value)
    return root


IMAGE_ENTRY_RE = re.compile(r"^(.*?\.(?:png|jpg|webp|PNG))(~[^:]*)?(?::.*)?$")


def split_top(s: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside [] and ()."""
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for c in s:
        if c in "[(":
            depth += 1
        elif c in "])":
            depth -= 1
        if c == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    out.append("".join(cur))
    return out


def expand_list(body: str) -> list[str]:
    """'1~4,3' -> ['1','2','3','4','3']; '01~03' keeps the zero padding; 'x*2' -> ['x','x']; '4~2' counts down."""
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        repeat = 1
        m = re.match(r"^(.*)\*(\d+)$", item)
        if m:
            item, repeat = m.group(1), int(m.group(2))
        m = re.match(r"^(\d+)~(\d+)$", item)
        if m:
            a, b = int(m.group(1)), int(m.group(2))
            width = len(m.group(1)) if m.group(1).startswith("0") else 0
            values = [str(x).zfill(width) for x in (range(a, b + 1) if a <= b else range(a, b - 1, -1))]
        else:
            values = [item]
        out.extend(values * repeat)
    return out


def expand_image_value(value: str) -> list[str]:
    """The image paths of one `image=` value: `a.png,b-[1~3].png:[100*3]` -> a.png, b-1.png, b-2.png, b-3.png.

    Durations (`:100`) and image-path functions (`~RC(...)`) are dropped; several bracket groups in one path
    advance together (the shorter list repeats its last value).
    """
    frames: list[str] = []
    for entry in split_top(value, ","):
        entry = entry.strip()
        if not entry:
            continue
        m = IMAGE_ENTRY_RE.match(entry)
        path = m.group(1) if m else entry.split(":")[0]
        groups = re.findall(r"\[([^\]]*)\]", path)
        if not groups:
            frames.append(path)
            continue
        lists = [expand_list(g) for g in groups]
        for k in range(max(len(v) for v in lists)):
            p = path
            for g, values in zip(groups, lists):
                p = p.replace("[" + g + "]", values[min(k, len(values) - 1)], 1)
            frames.append(p)
    return frames
