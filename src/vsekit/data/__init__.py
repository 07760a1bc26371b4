"""Dataset formats and loading: SCAN precomp (+ variable captions and clip frames), Karpathy JSON + raw
images, text and vocabularies, validation. Builders of particular sets live in `vsekit.datasets`."""

from vsekit.data.precomp import DataFormatError, PrecompSplit, load_precomp_split, write_precomp_split

__all__ = ["DataFormatError", "PrecompSplit", "load_precomp_split", "write_precomp_split"]
