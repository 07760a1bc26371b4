"""Builders of concrete datasets: each writes a folder in one of the formats of `vsekit.data`.

own_pairs + own_sources + own_shards + own_features (users' own pictures and captions: `vse data folder | table |
webdataset`) and show (montages of a split of any set). The builders of particular sets (openclipart, Wesnoth,
moving shapes, synthetic, video converters) are in the lab, `vsekit_lab.datasets`. Nothing in the library
below this layer imports a builder: training, evaluation and search read only the formats.
"""
