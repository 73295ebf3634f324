"""`python -m tinydraft_mlx.server`: the server's entry point (`tinydraft_mlx.serving.main`), under
the name users run and import."""

from .serving.main import Defaults, build_app, create_app, main, setup_arg_parser

__all__ = ["Defaults", "build_app", "create_app", "main", "setup_arg_parser"]

if __name__ == "__main__":
    import sys

    sys.exit(main())
