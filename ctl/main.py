"""colictl: the command line. Commands that need no daemon (run, demo-model) live in
ctl/offline.py and are imported only when called, so the client commands never load
numpy or numba."""

import click

from . import exitcodes


class LazyGroup(click.Group):
    """A group whose offline commands are imported when used, not at start."""

    LAZY = {"run": "run", "demo-model": "demo_model", "convert": "convert"}

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.LAZY))

    def get_command(self, ctx, name):
        if name in self.LAZY:
            from . import offline

            return getattr(offline, self.LAZY[name])
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="colibri", prog_name="colictl")
def cli():
    """colibri: run Mixture-of-Experts models far larger than RAM."""


def main():
    try:
        cli.main(standalone_mode=True)
    except KeyboardInterrupt:
        click.echo("colictl: interrupted", err=True)
        raise SystemExit(exitcodes.INTERRUPTED) from None
