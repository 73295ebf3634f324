"""`python -m tinydraft_mlx.generate`: the command line (`tinydraft_mlx.cli`), under the name
users run. For `-m` only: nothing imports this module, since importing it would rebind the
package attribute `tinydraft_mlx.generate` (the API function) to it; import `tinydraft_mlx.cli`.
"""

if __name__ == "__main__":
    import sys

    from tinydraft_mlx.cli import main

    sys.exit(main())
