"""`python -m tinydraft_mlx.generate`: the command line (`tinydraft_mlx.programs.cli`), under the
name users run. For `-m` only: nothing imports this module, since importing it would rebind the
package attribute `tinydraft_mlx.generate` (the API function) to it.
"""

if __name__ == "__main__":
    import sys

    from tinydraft_mlx.programs.cli import main

    sys.exit(main())
