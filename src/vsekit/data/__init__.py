"""Dataset formats: SCAN precomp (+ variable captions), Karpathy JSON + raw images, openclipart."""

from vsekit.data.precomp import DataFormatError, PrecompSplit, load_precomp_split, write_precomp_split

__all__ = ["DataFormatError", "PrecompSplit", "load_precomp_split", "write_precomp_split"]
