"""The command-line programs, on the generation API: `cli` (`python -m tinydraft_mlx.generate`,
`tinydraft-mlx`), `check` (`python -m tinydraft_mlx.check`: is a pair exact here, does it pay)
and `vocab` (`python -m tinydraft_mlx.vocab`: token counts for a pruned draft vocabulary). The
modules of those names in the package root only run them.
"""
