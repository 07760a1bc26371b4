"""What a reader of users' own pictures and captions hands the builder (`own_pairs.build_own_dataset`): the
items (a name to report, a key for the id, where the picture's bytes are, its captions, maybe a declared
split), the problems met on the way with their kinds, and what the input was; and the unique `Picture` the
checks make of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from vsekit.data.pictures import PICTURE_SUFFIXES  # noqa: F401  (the builders read it from here)
from vsekit.data.untrusted import MAX_PICTURE_BYTES, read_bounded
from vsekit.utils.printable import printable

# problem kinds (each reported with the name of the picture, caption file or table row)
UNREADABLE = "unreadable picture"
EMPTY_FILE = "empty file"
MISSING_FILE = "missing picture"
NO_CAPTION = "no caption"
EMPTY_CAPTION = "empty caption"
BAD_CAPTIONS = "unreadable captions"
DUPLICATE = "duplicate picture"
NAME_CLASH = "name clash"
BAD_NAME = "bad file name"
SPLIT_CONFLICT = "split conflict"
BROKEN_SHARD = "broken shard"
NO_PICTURE = "no picture"  # a shard sample of captions only, or a member no sample can be made of
# and the kinds of `vsekit.data.text.caption_problem` ("control character", "over-long caption"): a caption skipped
# kinds that leave a picture out (the others: a duplicate merged, a split resolved, a caption line dropped)
SKIPPING = (UNREADABLE, EMPTY_FILE, MISSING_FILE, NO_CAPTION, BAD_CAPTIONS, NAME_CLASH, BAD_NAME)


@dataclass(frozen=True)
class PictureRef:
    """Where a picture's bytes are: a file, or `size` bytes at `offset` of an uncompressed tar. A file with
    several names (a hard link) is refused when read unless `trust_links` (`vsekit.data.untrusted`)."""

    path: Path
    offset: int | None = None
    size: int | None = None
    trust_links: bool = False

    @property
    def is_file(self) -> bool:
        return self.offset is None

    def read(self) -> bytes:
        if self.offset is None:  # a path the reader resolved inside its root: no link followed, capped
            return read_bounded(
                self.path, MAX_PICTURE_BYTES, expected="a picture file", trust_links=self.trust_links
            )
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(self.size or 0)
        if len(data) != self.size:
            raise OSError(
                f"{self.path}: truncated ({len(data)} of {self.size} bytes at offset {self.offset})"
            )
        return data

    def stamp(self) -> str:
        """Key of the check cache: the file (resolved), its size, mtime and number of names, the member's
        place, and whether hard links are trusted (a result checked under `--trust-links`, or before a second
        name was made, is not reused without it)."""
        st = self.path.stat()
        links = f"{st.st_nlink}{'+trusted' if self.trust_links else ''}"
        return f"{self.path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{self.offset}|{self.size}|{links}"


@dataclass
class Item:
    """One picture of the input: `name` is what reports call it, `key` what its id is made from."""

    name: str
    key: str
    picture: PictureRef
    suffix: str
    captions: list[str]
    split: str | None = None


@dataclass(frozen=True)
class Problem:
    """One thing of the input that was skipped or changed; `str()` is how it is shown (warnings,
    `problems.txt`, `--strict`): the name and detail come from elsewhere, so they are `printable`."""

    name: str
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{printable(self.name)}: {self.kind}: {printable(self.detail)}"


@dataclass
class Collected:
    """What a reader found: the items, the problems met while reading, and what the input was."""

    items: list[Item]
    problems: list[Problem]
    source: dict
    declared_splits: bool = False
    notes: dict = field(default_factory=dict)


@dataclass
class Picture:
    """One unique picture of the output (duplicates merged)."""

    id: str
    sha256: str
    item: Item
    names: list[str]
    captions: list[str]
    split: str | None


def normalise_caption(text: str) -> str:
    """Whitespace (newlines, tabs) collapsed to single spaces: a caption must fit on one line."""
    return " ".join(str(text).split())
