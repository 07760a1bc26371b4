"""vsekit_lab: the lab beside the vsekit library (the open_clip / open_clip_train pattern), shipped in the same wheel.

It holds what is not the library: the builders of particular sets (`datasets`: openclipart, Wesnoth, moving
shapes, the shapes set of the search tests, synthetic precomp sets, video feature converters), the demo, the
benchmarks behind `vse bench …` and the experiments behind `vse experiment …`. It imports vsekit; vsekit never
imports it (an import-linter contract in pyproject.toml). Its `vse` verbs register through the entry-point groups
`vsekit.commands` and `vsekit.data_commands` (`vsekit_lab.commands`), which the `vse` command line reads.
"""
