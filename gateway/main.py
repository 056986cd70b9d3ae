"""colibri-gateway: serve the OpenAI API, /metrics and the live map over HTTP, in front of
colibrid's user socket. Loopback only unless told otherwise, with a bearer token."""

import ipaddress
import os
import sys

import click

EXIT_USAGE = 2
EXIT_START = 3  # the address cannot be listened on (in use, not this box's)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def read_token(path: str) -> str:
    """The bearer token in `path` (its first line). Raises click.UsageError."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except OSError as e:
        raise click.UsageError(f"--token-file {path}: {e.strerror}") from None
    if len(token) < 16:
        raise click.UsageError(f"--token-file {path}: the token must be at least 16 characters")
    if os.stat(path).st_mode & 0o077:
        click.echo(f"colibri-gateway: warning: {path} is readable by others; chmod 600 it", err=True)
    return token


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option("--socket", "socket_path", metavar="PATH", envvar="COLIBRI_SOCKET",
              help="colibrid's user socket (default: as colictl finds it)")
@click.option("--token-file", type=click.Path(dir_okay=False), metavar="FILE",
              help="a file whose first line is the bearer token every request must carry")
@click.option("--allow-remote", is_flag=True,
              help="listen on a non-loopback address (needs --token-file)")
@click.option("--max-body", type=click.IntRange(1024), default=1 << 20, show_default=True,
              help="the largest request body in bytes (larger: 413)")
@click.option("--trace", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="a routing trace (colictl run --routing-trace) the map's Atlas starts from")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info")
def main(host, port, socket_path, token_file, allow_remote, max_body, trace, log_level):
    """Serve colibrid over HTTP: /v1/chat/completions, /v1/completions, /v1/models,
    /metrics and the live expert map at /."""
    try:
        import uvicorn

        from .app import Gateway, make_app
    except ImportError as e:
        click.echo(f"colibri-gateway: {e.name} is not installed: pip install 'colibri[gateway]'", err=True)
        sys.exit(EXIT_USAGE)
    if not is_loopback(host) and not (allow_remote and token_file):
        click.echo(f"colibri-gateway: refusing to listen on {host}: a non-loopback address needs --allow-remote "
                   "and --token-file (the API runs the model for anyone who reaches it)", err=True)
        sys.exit(EXIT_USAGE)
    try:
        token = read_token(token_file) if token_file else None
    except click.UsageError as e:
        click.echo(f"colibri-gateway: {e.message}", err=True)
        sys.exit(EXIT_USAGE)
    # the address is bound here, before the server starts: a port in use is one line and an
    # exit code, not "Application startup complete" followed by an error
    try:
        sock = listening_socket(host, port)
    except OSError as e:
        click.echo(f"colibri-gateway: cannot listen on {host}:{port}: {e.strerror or e}", err=True)
        sys.exit(EXIT_START)
    gw = Gateway(socket_path, token, max_body, trace)
    app = make_app(gw)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug")
    click.echo(f"colibri-gateway: listening on http://{host}:{port} for colibrid at {gw.socket_path}", err=True)
    uvicorn.Server(config).run(sockets=[sock])


def listening_socket(host: str, port: int):
    """A TCP socket bound to host:port and listening. Raises OSError (e.g. the port in use)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    main()
