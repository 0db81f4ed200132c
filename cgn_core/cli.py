"""What every Cognitora executable shares: `--version`, `config`, exit codes, error rendering.

Exit codes (the same for all seven executables):

    0  success
    1  a runtime failure (a peer unreachable, a request refused)
    2  bad usage or bad configuration (unknown setting, wrong type, missing file)
"""

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
import yaml

from cgn_core import __version__
from cgn_core.errors import CognitoraError, ConfigError
from cgn_core.settings import load_settings, settings_to_dict

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

S = TypeVar("S")


def fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    """Print a one-line error for the user (no traceback) and exit with `code`."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def flag(name: str, help_: str, envvar: str | None = None) -> Any:
    """A typer option for a `serve`-style command whose default lives in the settings tree."""
    return typer.Option(name, help=help_, envvar=envvar, show_default=False)


def parse_overrides(pairs: list[str] | None) -> dict[str, str]:
    """`--set a.b=c` pairs as a {"a.b": "c"} mapping for `load_settings`."""
    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            fail(f"--set expects KEY=VALUE, got {pair!r}", EXIT_USAGE)
        out[key.strip()] = value
    return out


def load_service_settings(
    cls: type[S], service: str, config: Path | None, overrides: dict[str, str]
) -> S:
    """flag > env > YAML > defaults, with a settings error turned into a one-line exit 2."""
    try:
        return load_settings(cls, service, yaml_path=config, env=os.environ, flags=overrides)
    except ConfigError as exc:
        fail(exc.message, EXIT_USAGE)


def make_app(service: str, help_text: str, settings_cls: type[Any]) -> typer.Typer:
    """A typer app for `cgn-<service>` with `--version` and a `config` command."""
    app = typer.Typer(
        name=f"cgn-{service}",
        help=help_text,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode="rich",
    )
    env_prefix = f"CGN_{service.upper()}"

    def show_version(value: bool) -> None:
        if value:
            typer.echo(f"cgn-{service} {__version__}")
            raise typer.Exit()

    @app.callback()
    def _root(
        version: Annotated[
            bool,
            typer.Option(
                "--version",
                callback=show_version,
                is_eager=True,
                help="Print the version and exit.",
            ),
        ] = False,
    ) -> None:
        pass

    @app.command("config")
    def _config(
        config: Annotated[
            Path | None,
            typer.Option(
                "--config", "-c", envvar=f"{env_prefix}_CONFIG", help="YAML settings file."
            ),
        ] = None,
        set_: Annotated[
            list[str] | None,
            typer.Option("--set", help="Override one setting: --set http.port=9000 (repeatable)."),
        ] = None,
        as_json: Annotated[
            bool, typer.Option("--json", help="Print JSON instead of YAML.")
        ] = False,
    ) -> None:
        """Print the effective settings (defaults < YAML < CGN_* env < --set) and exit.

        Environment variables are CGN_<SERVICE>_<PATH>, nested fields joined by a
        double underscore, e.g. CGN_ROUTER_HTTP__PORT=8081.
        """
        settings = load_service_settings(settings_cls, service, config, parse_overrides(set_))
        data = _masked(settings_to_dict(settings))
        if as_json:
            typer.echo(json.dumps(data, indent=2))
        else:
            typer.echo(yaml.safe_dump(data, sort_keys=False).rstrip())

    return app


def _masked(data: Any) -> Any:
    """Settings as printed: secrets (a field named *token*, *secret* or *password*) hidden."""
    if isinstance(data, dict):
        return {
            k: "***" if v and any(w in k for w in ("token", "secret", "password")) else _masked(v)
            for k, v in data.items()
        }
    return data


def run(app: typer.Typer) -> Callable[[], None]:
    """A console-script entry point: whatever escapes a command becomes one line and an exit
    code, never a traceback (the user gets what went wrong; a bug says it is one)."""

    def main() -> None:
        try:
            app()
        except CognitoraError as exc:
            typer.echo(f"error: {exc.message}", err=True)
            sys.exit(EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILURE)
        except OSError as exc:  # a full disk, a permission, a port in use, a missing file
            where = f"{exc.filename}: " if exc.filename else ""
            typer.echo(f"error: {where}{exc.strerror or exc}", err=True)
            sys.exit(EXIT_FAILURE)
        except UnicodeError as exc:
            typer.echo(f"error: not UTF-8 text ({exc})", err=True)
            sys.exit(EXIT_USAGE)
        except RecursionError:
            typer.echo("error: input nested too deeply", err=True)
            sys.exit(EXIT_USAGE)
        except KeyboardInterrupt:
            sys.exit(130)
        except Exception as exc:  # NOTE: the top of the program: a bug, said in one line
            typer.echo(
                f"error: unexpected {type(exc).__name__}: {exc} (a bug: please report it)", err=True
            )
            sys.exit(EXIT_FAILURE)

    return main
