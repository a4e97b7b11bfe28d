"""
python -m family: the command line of the family database's memories (family/memories.py) and its
snapshots (family/store.py).

    python -m family list --member ana
    python -m family add --member ana "A Lucía no le gusta el pescado" [--family] [--pin]
    python -m family forget --member ana 12
    python -m family export --member ana > ana.json
    python -m family snapshot
    python -m family restore var/snapshots/20261130T120000.000Z

The database is serve.database of configs/serve/default.yaml unless --db names another; a member's role
is their account's (serve/app.py's members table) unless --role says it.
"""

import argparse
import json
import os
import sqlite3
import sys

import config
import fileio
from family import memories, store

SERVE_CONFIG = os.path.join(os.path.dirname(memories.DEFAULT_CONFIG), "..", "serve", "default.yaml")


def account_role(conn, member, db_path):
    """The role of `member`'s account in the server's members table (serve/app.py owns it)."""
    has_accounts = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'members'"
    ).fetchone()
    row = (
        conn.execute("SELECT role FROM members WHERE name = ?", (member,)).fetchone()
        if has_accounts
        else None
    )
    if row is None:
        raise memories.MemoryStoreError(
            f"{db_path}: no account {member!r} (python -m serve member add {member} --role ...), or pass --role"
        )
    return row["role"]


def parse_args(argv):
    parser = argparse.ArgumentParser(description="Family memories and database snapshots.")
    parser.add_argument(
        "--db", help="the family database (default: serve.database of configs/serve/default.yaml)"
    )
    parser.add_argument(
        "--config", default=memories.DEFAULT_CONFIG, help="a memory layer file (configs/memory/*.yaml)"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("list", "add", "forget", "export"):
        sub = commands.add_parser(name)
        sub.add_argument("--member", required=True)
        sub.add_argument(
            "--role",
            choices=memories.ROLES,
            help="the member's role; by default their account's (serve/app.py member)",
        )
        if name == "add":
            sub.add_argument("text")
            sub.add_argument("--family", action="store_true", help="share it with the whole family")
            sub.add_argument("--pin", action="store_true", help="put it in every turn of this member")
        if name == "forget":
            sub.add_argument("id", type=int)
    commands.add_parser("snapshot")
    restore_parser = commands.add_parser("restore")
    restore_parser.add_argument("snapshot", help="a snapshot folder, e.g. var/snapshots/20261130T120000.000Z")
    return parser.parse_args(argv)


@fileio.reports_storage_errors
@fileio.takes_text_arguments()
def main(argv):
    os.umask(store.PRIVATE_UMASK)  # snapshots and the database are private, as the server's own
    args = parse_args(argv)
    try:
        cfg = memories.load_config(args.config)
        args.db = args.db or config.load_layer("serve", SERVE_CONFIG)["database"]
        if args.command == "snapshot":
            store.snapshot(args.db, cfg)
            return 0
        if args.command == "restore":
            store.restore(args.snapshot, args.db)
            return 0
        conn = memories.connect(args.db, cfg)
        args.role = args.role or account_role(conn, args.member, args.db)
        if args.command == "list":
            for memory in memories.list_memories(conn, args.member, args.role):
                pin = "*" if memory["pinned"] else " "
                print(f"{memory['id']:>6} {pin} {memory['scope']:<7} {memory['member']:<12} {memory['text']}")
        elif args.command == "add":
            scope = "family" if args.family else "private"
            memory_id = memories.add(
                conn, args.member, args.role, args.text, cfg, scope=scope, pinned=args.pin
            )
            print(f"memory {memory_id} stored ({scope})")
        elif args.command == "forget":
            memory = memories.forget(conn, args.member, args.role, args.id)
            print(f"memory {memory['id']} deleted: {memory['text']}")
        elif args.command == "export":
            print(json.dumps(memories.export(conn, args.member, args.role), ensure_ascii=False, indent=1))
        conn.close()
    except (config.ConfigError, memories.MemoryStoreError, store.SnapshotError, sqlite3.Error) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
