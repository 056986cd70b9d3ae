"""How a colictl client command reaches colibrid: `with_client` gives it a Client on the user or
the operator socket and turns a daemon that is down, a socket it may not use and every
error reply into one line and an exit code (`fail`)."""

import functools
import sys

import click

from . import exitcodes
from .options import BadInput, NoPrompt


def fail(message: str, code: int):
    click.echo(f"colictl: {message}", err=True)
    raise SystemExit(code)


START_WAIT_S = 60  # --wait: how long a daemon may take to bind its socket


def with_client(fn=None, operator: bool = False):
    """Give the command a Client (to the operator socket with `operator`; it connects at its first request);
    daemon down, permission denied and error replies become one line and an exit code."""
    if fn is None:
        return functools.partial(with_client, operator=operator)

    @functools.wraps(fn)
    @click.pass_context
    def wrapper(ctx, *args, **kwargs):
        from .client import BadSocket, Client, DaemonDown, PermissionDenied, ReplyError, TooLarge

        client = Client(ctx.obj["socket"], operator=operator, operator_path=ctx.obj["operator"])
        client.wait_s = START_WAIT_S if kwargs.get("wait") else 0
        try:  # the client connects at its first request: a command checks its input before that
            return fn(client, *args, **kwargs)
        except BadSocket as e:
            fail(str(e), exitcodes.USAGE)
        except (NoPrompt, BadInput) as e:
            fail(str(e), exitcodes.USAGE if isinstance(e, NoPrompt) else exitcodes.BAD_REQUEST)
        except DaemonDown as e:
            fail(str(e), exitcodes.DAEMON_DOWN)
        except PermissionDenied as e:
            fail(str(e), exitcodes.PERMISSION)
        except TooLarge as e:
            fail(f"TOO_LARGE: {e}", exitcodes.BAD_REQUEST)
        except ReplyError as e:
            fail(f"{e.name}: {e}", exitcodes.FROM_ERROR.get(e.name, exitcodes.INTERNAL))
        except BrokenPipeError:
            sys.stderr.close()
            raise SystemExit(exitcodes.OK) from None
        finally:
            client.close()

    return wrapper
