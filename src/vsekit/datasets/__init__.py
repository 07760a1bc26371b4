"""Builders of concrete datasets: each writes a folder in one of the formats of `vsekit.data`.

openclipart (the demo's drawings), wesnoth (unit-animation clips), moving_shapes (generated clips),
synthetic (random precomp sets for tests), video_convert (MSR-VTT / VATEX / HGR feature dumps), show
(montages of a split), own_pairs + own_sources + own_features (users' own pictures and captions:
`vse data folder | table | webdataset`). Nothing in the library below this layer imports a builder: training, evaluation and
search read only the formats.
"""
