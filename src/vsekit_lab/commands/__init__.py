"""The lab's `vse` verbs (`vse demo`, `vse bench …`, `vse experiment …`) and `vse data` sub-verbs (openclipart,
convert-video, synthetic, moving-shapes, wesnoth). Each module has `register(subparsers)`; pyproject.toml names
them in the entry-point groups `vsekit.commands` and `vsekit.data_commands`, which `vse` reads."""
