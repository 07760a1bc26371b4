"""Build a small, real image-text retrieval set from Debian's `openclipart-svg` (public-domain clip art).

Why this set: it installs offline from the distribution mirror, carries real human-written text
(Dublin Core title / description / keywords inside every SVG), and renders to clean 224 px pictures.
The output is the SCAN "precomp" layout with vsekit's variable-captions extension (`{split}_cap2img.txt`),
which `vsekit.data.precomp` reads.

Pipeline (each stage cached under `out_dir/.cache`, so a re-run is fast and an interrupted run resumes):
1. parse every SVG (whole document with ElementTree) -> title, description, keywords, creator;
2. de-duplicate identical drawings filed in several category folders (md5 of the SVG minus <metadata>);
3. label: a distinctive title, else a readable file-name stem, else drop (see `CAPTION_RULES`);
4. rasterise (cairosvg, fallback rsvg-convert) at 512 px, crop to content, pad square, 224 px PNG;
5. seeded split by image; EfficientNet-Lite0 grid features (49 x 1280, fp16); manifest with sha256s.

Modules, one job each: `source` (the SVG folder), `metadata` (Dublin Core parsing), `text` (text repair),
`labels` (labels and captions), `render` (rasterising), `features` (cached grid features), `build`.
"""

from vsekit_lab.datasets.openclipart.build import (
    FORMAT,
    SPLITS,
    assign_splits,
    build_openclipart,
    split_sizes,
)
from vsekit_lab.datasets.openclipart.labels import (
    CAPTION_RULES,
    Drawing,
    assign_labels,
    make_captions,
    merge_duplicates,
    stem_label,
)
from vsekit_lab.datasets.openclipart.metadata import SvgMetadataError, parse_all, parse_svg_metadata
from vsekit_lab.datasets.openclipart.render import RENDER_SIZE, RENDER_VERSION, crop_square, render_svg
from vsekit_lab.datasets.openclipart.source import DEFAULT_SVG_ROOT, ensure_svg_root, find_svgs

__all__ = [
    "build_openclipart",
    "parse_svg_metadata",
    "parse_all",
    "merge_duplicates",
    "assign_labels",
    "make_captions",
    "stem_label",
    "render_svg",
    "crop_square",
    "assign_splits",
    "split_sizes",
    "ensure_svg_root",
    "find_svgs",
    "CAPTION_RULES",
    "Drawing",
    "SvgMetadataError",
    "DEFAULT_SVG_ROOT",
    "FORMAT",
    "RENDER_SIZE",
    "RENDER_VERSION",
    "SPLITS",
]
