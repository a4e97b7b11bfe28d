"""
`python -m serve member add | list | remove | new-key | password`: the family's accounts (family/accounts.py's
store) from the command line. serve/app.py hands it the command line and its way of reading the serve layer, so
the database and the password rules are the server's own.
"""

import argparse
import getpass
import sys

import config
import fileio
from family import accounts


def read_password(settings, role, stream=sys.stdin):
    """The password typed twice on a terminal, or one line of stdin. Bytes that are not in the terminal's
    encoding are refused: the same password typed on another device would not match."""
    not_text = accounts.AccountError(
        "the password is not valid UTF-8: the terminal sends another encoding than the locale says; set it to "
        "UTF-8 and type the password again"
    )
    try:
        if stream.isatty():
            password = getpass.getpass("password or PIN: ")
            if getpass.getpass("again: ") != password:
                raise accounts.AccountError("the two passwords differ")
        else:
            password = stream.readline().rstrip("\n")
    except UnicodeDecodeError:  # a strict decoder (a UTF-8 locale)
        raise not_text from None
    if fileio.LONE_SURROGATE.search(password):  # a surrogateescape decoder (the C locale)
        raise not_text
    problem = accounts.password_problem(password, settings, role)
    if problem:
        raise accounts.AccountError(problem)
    return password


def main(argv, load_settings, default_config):
    """`python -m serve member ...`: load_settings(path, overrides) gives the serve layer."""
    parser = argparse.ArgumentParser(prog="python -m serve member", description="Family accounts.")
    parser.add_argument("--config", default=default_config, help="serve layer file (configs/serve/*.yaml)")
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add", help="create a member and print their API key once")
    add.add_argument("name")
    add.add_argument("--role", choices=accounts.ROLES, required=True)
    for name, text in (("remove", "delete a member with their conversations, feedback and memories"),
                       ("new-key", "replace a member's API key and print the new one"),
                       ("password", "set the web password or PIN (asked twice, or one line on stdin)")):  # fmt: skip
        commands.add_parser(name, help=text).add_argument("name")
    commands.add_parser("list", help="members and roles")
    overrides = [a for a in argv if config.is_override(a, "serve")]  # serve.key=value anywhere on the line
    args = parser.parse_args([a for a in argv if a not in overrides])
    settings = load_settings(args.config, overrides)
    store = accounts.Store(settings["database"], settings["busy_timeout_ms"])
    if args.command == "add":
        key = store.add_member(args.name, args.role)
        print(f"member {args.name} ({args.role}) added; API key (shown only now):\n{key}")
    elif args.command == "list":
        for m in store.members():
            web = "web password set" if m["has_password"] else "no web password"
            web += " (provisional: the member must change it)" if m["provisional"] else ""
            print(f"{m['name']:20s} {m['role']:6s} {web}")
    elif args.command == "remove":
        if not store.remove_member(args.name):
            raise accounts.AccountError(f"no member {args.name!r}")
        print(f"member {args.name} removed with their conversations, feedback and memories")
    elif args.command == "new-key":
        key = store.new_key(args.name)
        if key is None:
            raise accounts.AccountError(f"no member {args.name!r}")
        print(f"new API key of {args.name} (the old one no longer works):\n{key}")
    else:
        member = store.member(args.name)
        if member is None:
            raise accounts.AccountError(f"no member {args.name!r}")
        password = read_password(settings, member["role"])
        store.set_password(args.name, accounts.hash_password(password, settings["scrypt"]))
        print(f"web password of {args.name} set; their web sessions have ended")
    return 0
