"""Builders of particular sets, each writing a folder in one of the formats of `vsekit.data`.

openclipart (the demo's drawings), wesnoth (unit-animation clips), moving_shapes (generated clips), shapes (the
tiny picture set of the search tests), synthetic (random precomp sets for tests), video_convert (MSR-VTT / VATEX
/ HGR feature dumps). Users' own pictures and captions are built by the library (`vsekit.datasets`).
"""
