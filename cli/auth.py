"""``sluice auth init``: broker roles for a deployment, as a nats-server config include and one
env file per user.

The include (``auth.conf``) holds one account with JetStream and a user per identity
(:mod:`sluice.common.brokerroles`), passwords stored as bcrypt hashes, and, with ``--tls``, a
``tls`` block. Each env file (``users/<user>.env``, readable by its owner only) holds what a
process running as that user sets: ``SLUICE_NATS_USER``, ``SLUICE_NATS_PASSWORD``,
``SLUICE_NATS_INBOX_PREFIX`` and the role's own settings (a producer's tenant, an agent's
worker id).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import bcrypt
import typer

from sluice.cli.console import err, fail
from sluice.common.brokerroles import BrokerUser, Permissions, layout
from sluice.schemas.names import DEFAULT_BANDS

app = typer.Typer(help="Broker roles: NATS users and permissions per role.", no_args_is_help=True)

AUTH_FILE = "auth.conf"
USERS_DIR = "users"
ACCOUNT = "SLUICE"
BCRYPT_COST = 11
"""nats-server checks the hash on every connect: 11 is what ``nats server passwd`` uses (a
tenth of a second or so per connect, and per user written here)."""
MIN_BCRYPT_COST = 4
"""bcrypt's own minimum."""
PASSWORD_BYTES = 24


@dataclass(frozen=True)
class TlsFiles:
    """The server's certificate and key, and a CA the processes verify it with."""

    cert: Path
    key: Path
    ca: Path | None = None
    verify_clients: bool = False


def _q(value: str) -> str:
    """A quoted nats-server config string (JSON's quoting is the config's)."""
    return json.dumps(value)


def _subjects(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(_q(s) for s in items) + "]"


def _permissions(p: Permissions) -> list[str]:
    pub = f"allow: {_subjects(p.publish)}"
    if p.publish_deny:
        pub += f", deny: {_subjects(p.publish_deny)}"
    sub = f"allow: {_subjects(p.subscribe)}"
    if p.subscribe_deny:
        sub += f", deny: {_subjects(p.subscribe_deny)}"
    lines = [f"publish: {{{pub}}}", f"subscribe: {{{sub}}}"]
    if p.allow_responses:
        lines.append("allow_responses: true")
    return lines


def render_auth(users: list[tuple[BrokerUser, str]], tls: TlsFiles | None = None) -> str:
    """The nats-server config include for ``users`` (each with its password's bcrypt hash)."""
    out = [
        "# Sluice broker roles, written by `sluice auth init`: include it from the server's",
        "# config (include auth.conf). Passwords are bcrypt hashes; the plain ones are in",
        "# users/<user>.env only. `sluice auth init --force` again adds users (--rotate: new",
        "# passwords for all); then reload the server (nats-server --signal reload).",
        "accounts {",
        f"  {ACCOUNT} {{",
        "    jetstream: enabled",
        "    users: [",
    ]
    for user, hashed in users:
        out.append(f"      # {user.role}")
        out.append(f"      {{user: {_q(user.name)}, password: {_q(hashed)}, permissions: {{")
        out += [f"        {line}" for line in _permissions(user.permissions)]
        out.append("      }}")
    out += ["    ]", "  }", "}"]
    if tls is not None:
        out += ["tls {", f"  cert_file: {_q(str(tls.cert))}", f"  key_file: {_q(str(tls.key))}"]
        if tls.ca is not None:
            out.append(f"  ca_file: {_q(str(tls.ca))}")
        if tls.verify_clients:
            out.append("  verify: true")
        out.append("}")
    return "\n".join(out) + "\n"


def render_env(user: BrokerUser, password: str, nats_url: str, tls: TlsFiles | None) -> str:
    """The env file of one user: the settings a process running as it sets."""
    values = {
        "SLUICE_NATS_URL": nats_url,
        "SLUICE_NATS_USER": user.name,
        "SLUICE_NATS_PASSWORD": password,
        "SLUICE_NATS_INBOX_PREFIX": user.inbox_prefix,
        **user.settings,
    }
    if tls is not None and tls.ca is not None:
        values["SLUICE_NATS_TLS_CA"] = str(tls.ca)
    head = f"# Sluice {user.role} {user.name}: secret, for the processes of this role only.\n"
    return head + "".join(f"{k}={shlex.quote(v)}\n" for k, v in values.items())


def write_layout(
    out: Path,
    users: list[BrokerUser],
    *,
    nats_url: str,
    tls: TlsFiles | None = None,
    force: bool = False,
    rotate: bool = False,
    bcrypt_cost: int = BCRYPT_COST,
) -> dict[str, str]:
    """Write ``auth.conf`` and ``users/<user>.env`` under ``out``; return the plain password
    of each user. Refuses to replace an existing ``auth.conf`` unless ``force``. A user whose
    env file exists keeps its password (adding a tenant or a worker disconnects no one)
    unless ``rotate``: then every user gets a new one."""
    auth = out / AUTH_FILE
    if auth.exists() and not force:
        raise FileExistsError(f"{auth} exists: --force replaces it (--rotate: new passwords)")
    kept = {} if rotate else _existing_passwords(out / USERS_DIR)
    passwords = {u.name: kept.get(u.name) or secrets.token_urlsafe(PASSWORD_BYTES) for u in users}
    hashed = [
        (
            u,
            bcrypt.hashpw(
                passwords[u.name].encode(), bcrypt.gensalt(bcrypt_cost, prefix=b"2a")
            ).decode(),
        )
        for u in users
    ]
    (out / USERS_DIR).mkdir(parents=True, exist_ok=True)
    for u in users:
        _write_secret(
            out / USERS_DIR / f"{u.name}.env", render_env(u, passwords[u.name], nats_url, tls)
        )
    _write_secret(auth, render_auth(hashed, tls))
    return passwords


def _existing_passwords(folder: Path) -> dict[str, str]:
    """The passwords of the env files already in ``folder``, by user."""
    out: dict[str, str] = {}
    for path in folder.glob("*.env"):
        values = dict(
            line.split("=", 1)
            for line in path.read_text().splitlines()
            if "=" in line and not line.startswith("#")
        )
        user, password = values.get("SLUICE_NATS_USER"), values.get("SLUICE_NATS_PASSWORD")
        if user and password:
            out[shlex.split(user)[0]] = shlex.split(password)[0]
    return out


def _write_secret(path: Path, text: str) -> None:
    """Write ``text`` to a file only its owner can read (created so: never readable by
    others, not even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


@app.command("init")
def init(
    out: Annotated[Path, typer.Option("--out", help="Folder to write into.")] = Path("deploy/nats"),
    tenant: Annotated[
        list[str] | None, typer.Option("--tenant", help="A producer user per tenant.")
    ] = None,
    worker: Annotated[
        list[str] | None, typer.Option("--worker", help="An agent user per worker id.")
    ] = None,
    band: Annotated[
        list[str] | None,
        typer.Option("--band", help="The dispatchers' bands (default: the default bands)."),
    ] = None,
    nats_url: Annotated[
        str, typer.Option("--nats-url", help="The URL the env files give the processes.")
    ] = "nats://127.0.0.1:4222",
    tls: Annotated[bool, typer.Option("--tls", help="Add a tls block to auth.conf.")] = False,
    tls_cert: Annotated[
        Path,
        typer.Option("--tls-cert", help="--tls: the server's certificate (relative: to --out)."),
    ] = Path("tls/server-cert.pem"),
    tls_key: Annotated[Path, typer.Option("--tls-key", help="--tls: its key.")] = Path(
        "tls/server-key.pem"
    ),
    tls_ca: Annotated[
        Path | None,
        typer.Option("--tls-ca", help="--tls: the CA the processes verify the server with."),
    ] = None,
    tls_verify_clients: Annotated[
        bool, typer.Option("--tls-verify-clients", help="--tls: require client certificates.")
    ] = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="Replace an existing auth.conf (users keep passwords)."),
    ] = False,
    rotate: Annotated[
        bool, typer.Option("--rotate", help="With --force: every user gets a new password.")
    ] = False,
    bcrypt_cost: Annotated[
        int,
        typer.Option(
            "--bcrypt-cost", min=MIN_BCRYPT_COST, max=31, help="bcrypt work factor of the hashes."
        ),
    ] = BCRYPT_COST,
) -> None:
    """Write a nats-server config include with a user per role (dispatcher, gateway,
    operator, a producer per --tenant, an agent per --worker) and an env file per user."""
    if not tenant and not worker:
        err.print("no --tenant and no --worker: only the dispatcher, gateway and operator")
    files = None
    if tls:

        def under_out(p: Path) -> Path:
            # nats-server reads relative paths from its working directory: write absolute ones
            return (p if p.is_absolute() else out / p).resolve()

        files = TlsFiles(
            under_out(tls_cert),
            under_out(tls_key),
            None if tls_ca is None else under_out(tls_ca),
            tls_verify_clients,
        )
    users = layout(tenant or [], worker or [], tuple(band or DEFAULT_BANDS))
    try:
        write_layout(
            out,
            users,
            nats_url=nats_url,
            tls=files,
            force=force,
            rotate=rotate,
            bcrypt_cost=bcrypt_cost,
        )
    except (FileExistsError, ValueError) as exc:
        raise fail(str(exc)) from exc
    except OSError as exc:
        raise fail(f"cannot write {out}: {exc}") from exc
    print(f"wrote {out / AUTH_FILE} and {len(users)} env files in {out / USERS_DIR}/")
    print(f"  nats-server: add 'include {AUTH_FILE}' to its config, then reload it")
    print("  each process: load its user's env file (set -a; . users/<user>.env; set +a),")
    print("  e.g. users/dispatcher.env for `sluice dispatcher`, users/agent-<worker>.env for")
    print("  `sluice agent`, users/producer-<tenant>.env for a client, users/operator.env for")
    print("  the sluice commands, users/gateway.env for `sluice gateway`")
