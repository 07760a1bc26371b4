"""A real, offline video–text set from Battle for Wesnoth unit animations (docs/wesnoth.md).

Source: the Debian package `wesnoth-1.16-data` (GPL-2.0-or-later). Every unit type's `.cfg` file describes
its animations in WML ([attack_anim], [defend], [death], [idle_anim], ...) as sequences of sprite frames
(`image="units/human-loyalists/spearman-attack-s-[1~14].png:[100*14]"`). One clip = one animation block of
one unit type, one [if]/[else] branch (direction, hit or miss); its frames are the sprites, composited on a
fixed grey background, and each frame becomes one 1280-d EfficientNet-Lite0 vector (the 7x7 grid averaged).

Pipeline:
1. find the data: `source` (an extracted package root, the `data` folder itself, or a `.deb`), else an
   installed `/usr/share/games/wesnoth/*/data`, else `apt-get download wesnoth-1.16-data` into a cache folder;
2. parse: a small WML preprocessor (#define/#enddef macros with #arg defaults, {MACRO args}, #ifdef treated
   as "not defined"), a WML tag/attribute parser, image-path expansion (`x-[1~4,3].png`, `[a,b]`, `*n`);
3. clips: one per animation branch with at least 2 distinct frames found on disk; identical frame sequences of
   one unit (variant) kept once; captions from real names in the data (see `CAPTION_RULES`);
4. split by advancement family (`advances_to`, connected components) in a fixed md5 order: test takes families
   until 10 % of the clips, dev the next 10 %, train the rest, so no unit line is in two splits;
5. render + features (each distinct sprite once, batched), write the frames layout (`vsekit.data.frames`),
   `{split}_caps.txt`, `_cap2img.txt`, `_ids.txt`, `_clips.jsonl`, `manifest.json`, README.md and the licence.

Modules, one job each: `wml` (preprocessor, parser, image paths), `units`, `captions`, `clips` (clips and
splits), `frames` (rendering and features), `source` (finding the package), `build`.
"""

from vsekit_lab.datasets.wesnoth.build import build_wesnoth
from vsekit_lab.datasets.wesnoth.captions import CAPTION_RULES, action_caption
from vsekit_lab.datasets.wesnoth.clips import assign_splits, drop_repeated_captions, families, make_clips
from vsekit_lab.datasets.wesnoth.frames import EfficientNetFrameMean, render_frame
from vsekit_lab.datasets.wesnoth.source import locate_source
from vsekit_lab.datasets.wesnoth.units import parse_units
from vsekit_lab.datasets.wesnoth.wml import collect_macros, expand, expand_image_value, parse_wml

__all__ = [
    "build_wesnoth",
    "parse_units",
    "make_clips",
    "assign_splits",
    "drop_repeated_captions",
    "families",
    "action_caption",
    "expand_image_value",
    "expand",
    "collect_macros",
    "parse_wml",
    "locate_source",
    "render_frame",
    "EfficientNetFrameMean",
    "CAPTION_RULES",
]
