"""Builders of concrete datasets: each writes a folder in one of the formats of `vsekit.data`.

openclipart (the demo's drawings), wesnoth (unit-animation clips), moving_shapes (generated clips),
synthetic (random precomp sets for tests), video_convert (MSR-VTT / VATEX / HGR feature dumps), show
(montages of a split). Nothing in the library below this layer imports a builder: training, evaluation and
search read only the formats.
"""
