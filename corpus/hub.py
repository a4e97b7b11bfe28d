"""
Hub sources: the files a source's `hub` names (a Hugging Face dataset, a glob of its files and a size),
fetched into the source's hub.local_dir, where its `path` glob reads them.

    python -m corpus download CONFIG [section.key=value ...]

For each source with `hub`: the dataset's revision is resolved to a commit, its files under the glob are
listed (sizes and sha256 from the Hub's tree), sorted by name and cut at hub.max_files / hub.max_bytes.
Before the first byte the free space of each disk is checked against what is left to fetch. Files are
fetched by huggingface_hub (hf_hub_download: HTTP or Xet, its own retries), data.corpus.download.workers at a
time, and each one is checked against the Hub's checksum (the LFS sha256, or git's blob hash of a small
file): a corrupt file is fetched once more, then named in the error. Verified files are recorded in
local_dir/hub_files.json (size, mtime, sha256): a rerun, after a kill too, skips them without reading them.

The endpoint is HF_ENDPOINT (default https://huggingface.co) and a token with access rights is read from
HF_TOKEN; it is sent to the endpoint only and never written anywhere.

Offline (HF_HUB_OFFLINE=1, huggingface_hub's own switch; `make run OFFLINE=1` sets it) no server is asked:
each source's files as its last download recorded them (repo, revision, names and checksums in
local_dir/hub_files.json, copied along with the files from the machine that fetched them) are checked on
disk instead, and a missing file or a differing checksum is one line naming the file.
"""

import concurrent.futures
import fnmatch
import glob
import math
import os
import shutil

from tqdm import tqdm

from data import DataError
from fileio import write_json

RECORD = "hub_files.json"  # in each local_dir: the files verified there


def hub_sources(sources, key="data.corpus.sources"):
    """[(label, source)] of the sources that name a Hub dataset; label says where the config has it."""
    return [
        (f"{key}[{index}] ({source['name']})", source)
        for index, source in enumerate(sources)
        if "hub" in source
    ]


def size_text(size):
    """A byte count in a unit that fits: 512 bytes, 1.22 MB, 3.40 GB (powers of 1000)."""
    if size < 1000:
        return f"{size:,} bytes"
    power = min(5, int(math.log10(size) // 3))
    if power < 5 and round(size / 1000**power, 2) >= 1000:  # 999,999 bytes: 1.00 MB, not 1000.00 kB
        power += 1
    return f"{size / 1000**power:.2f} {' kMGTP'[power]}B"


def cause_chain(e):
    """e and the errors it wraps (its __cause__, else its __context__), outermost first."""
    chain = []
    while e is not None and all(e is not seen for seen in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def hub_error(e, what):
    """A huggingface_hub error as one line naming what was asked for. huggingface_hub wraps the real cause
    of a failed force_download (a refusal, a lost connection) in "Force download failed due to the above
    error.": the cause is what is named."""
    from huggingface_hub import errors

    chain = cause_chain(e)
    known = (
        errors.GatedRepoError,
        errors.RepositoryNotFoundError,
        errors.RevisionNotFoundError,
        errors.EntryNotFoundError,
        errors.HfHubHTTPError,
    )
    e = next((error for error in chain if isinstance(error, known)), chain[-1])
    if isinstance(e, errors.GatedRepoError):
        return f"{what}: access refused (a gated dataset: accept its terms on the Hub and set HF_TOKEN)"
    if isinstance(e, errors.RepositoryNotFoundError):
        return f"{what}: no such dataset on the Hub, or it is private (set HF_TOKEN)"
    if isinstance(e, errors.RevisionNotFoundError):
        return f"{what}: no such revision on the Hub"
    if isinstance(e, errors.EntryNotFoundError):
        return f"{what}: missing on the Hub"
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else "no message"
    return f"{what}: {first_line} ({type(e).__name__})"


def hub_api():
    from huggingface_hub import HfApi

    return HfApi(endpoint=os.environ.get("HF_ENDPOINT"), token=os.environ.get("HF_TOKEN"))


def plan_source(api, label, source):
    """(commit, [{"path", "size", "sha256" or "git_sha1"}]) of the files this source asks for, in name order."""
    hub = source["hub"]
    what = f"{label}.hub: {hub['repo']}@{hub['revision']}"
    prefix = hub["files"].split("*")[0].split("?")[0].split("[")[0].rsplit("/", 1)
    folder = prefix[0] if len(prefix) == 2 else None
    try:
        info = api.dataset_info(hub["repo"], revision=hub["revision"])
        entries = api.list_repo_tree(
            hub["repo"], path_in_repo=folder, recursive=True, revision=info.sha, repo_type="dataset"
        )
        files = sorted(
            (e for e in entries if hasattr(e, "size") and fnmatch.fnmatchcase(e.path, hub["files"])),
            key=lambda e: e.path,
        )
    except Exception as e:  # huggingface_hub's HTTP and connection errors
        raise DataError(hub_error(e, what)) from None
    if not files:
        raise DataError(f"{what}: no file on the Hub matches files {hub['files']!r}")
    chosen, total = [], 0
    for entry in files:
        if hub.get("max_files") is not None and len(chosen) >= hub["max_files"]:
            break
        if hub.get("max_bytes") is not None and chosen and total + entry.size > hub["max_bytes"]:
            break
        checksum = {"sha256": entry.lfs.sha256} if entry.lfs is not None else {"git_sha1": entry.blob_id}
        chosen.append({"path": entry.path, "size": entry.size} | checksum)
        total += entry.size
    licence = getattr(info.card_data, "license", None) if info.card_data is not None else None
    return {"commit": info.sha, "licence_on_hub": licence, "files": chosen}


def local_path(source, entry):
    return os.path.join(source["hub"]["local_dir"], entry["path"])


def read_record(local_dir):
    import json

    path = os.path.join(local_dir, RECORD)
    if not os.path.exists(path):
        return {"files": {}}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:
        raise DataError(f"{path}: unreadable ({e}); delete it (the files are checked again)") from None


def checksum_of(path, entry):
    """The file's checksum in the Hub's terms: sha256 for an LFS file, git's blob sha1 for a small one."""
    from huggingface_hub.utils.sha import git_hash, sha_fileobj

    with open(path, "rb") as f:
        return sha_fileobj(f).hex() if "sha256" in entry else git_hash(f.read())


def expected(entry):
    return entry.get("sha256") or entry["git_sha1"]


def is_verified(path, entry, record):
    """A file this command verified before and nobody touched since (size and mtime as recorded)."""
    seen = record["files"].get(entry["path"])
    return (
        seen is not None
        and os.path.isfile(path)
        and seen["checksum"] == expected(entry)
        and seen["size"] == os.path.getsize(path)
        and seen["mtime_ns"] == os.stat(path).st_mtime_ns
    )


def existing_folder(path):
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_space(todo):
    """Refuse before the first byte when a disk has less free space than the files left for it."""
    needed = {}
    for source, label, entry in todo:
        folder = existing_folder(source["hub"]["local_dir"])
        device = os.stat(folder).st_dev
        bytes_so_far, _, names = needed.get(device, (0, folder, []))
        needed[device] = (
            bytes_so_far + entry["size"],
            folder,
            names + [f"{label}.hub.max_bytes"],
        )
    for size, folder, names in needed.values():
        free = shutil.disk_usage(folder).free
        if size > free:
            raise DataError(
                f"{folder}: {size_text(size)} to download but {size_text(free)} free on that disk; free "
                f"space or lower {', '.join(sorted(set(names)))}"
            )


def forwarding_bar(total_bar, counted):
    """A tqdm class for hf_hub_download whose bytes go to the one bar of the whole download; counted[0]
    adds up what this file put on it (a resumed file's bytes already on disk too)."""

    class Forward(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            super().__init__(*args, **(kwargs | {"disable": True}))
            self.forward(kwargs.get("initial") or 0)

        def update(self, n=1):
            self.forward(n)

        def forward(self, n):
            if n:
                counted[0] += n
                total_bar.update(n)

    return Forward


def fetch(source, commit, entry, bar, counted, force=False):
    """hf_hub_download one file into local_dir; returns its path."""
    from huggingface_hub import hf_hub_download

    hub = source["hub"]
    return hf_hub_download(
        hub["repo"],
        entry["path"],
        repo_type="dataset",
        revision=commit,
        local_dir=hub["local_dir"],
        endpoint=os.environ.get("HF_ENDPOINT"),
        token=os.environ.get("HF_TOKEN"),
        force_download=force,
        tqdm_class=forwarding_bar(bar, counted),
    )


def fetch_and_verify(source, label, commit, entry, bar):
    """Fetch (again, if the first copy is corrupt) and check; returns the verified file's record entry."""
    what = f"{label}: {source['hub']['repo']}@{commit[:12]}:{entry['path']}"
    path = local_path(source, entry)
    counted = [0]  # bytes of this file on the bar: taken back before a second fetch, so none counts twice
    for attempt in range(2):
        bar.update(-counted[0])
        counted[0] = 0
        try:
            fetch(source, commit, entry, bar, counted, force=attempt > 0 or os.path.exists(path))
        except Exception as e:  # huggingface_hub's HTTP and connection errors
            raise DataError(hub_error(e, what) + "; run the command again: finished files are kept") from None
        got = checksum_of(path, entry)
        if got == expected(entry):
            bar.update(entry["size"] - counted[0])  # the bar ends on the file's size, whatever was streamed
            return {"checksum": got, "size": os.path.getsize(path), "mtime_ns": os.stat(path).st_mtime_ns}
        bar.write(
            f"download: {path}: checksum {got[:12]}… differs from the Hub's {expected(entry)[:12]}…; fetching again"
        )
    os.remove(path)
    raise DataError(
        f"{path}: corrupt after two downloads (checksum {got}, the Hub says {expected(entry)} for {what}); "
        "the file was removed; check the disk and the network, then run the command again"
    )


def download(data_cfg, log=print):
    """Fetch every Hub source's files of the corpus into its local_dir, skipping the ones verified before."""
    corpus_cfg = data_cfg["corpus"]
    sources = hub_sources(corpus_cfg["sources"])
    if not sources:
        log("download: no source names a Hub dataset (data.corpus.sources[].hub); nothing to do")
        return []
    return download_sources(sources, corpus_cfg["download"]["workers"], log, check_files=check_path_glob)


def offline():
    """huggingface_hub's HF_HUB_OFFLINE (read by it when imported; tests switch it in its constants)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def download_sources(sources, workers, log=print, check_files=None):
    """Fetch the files of these (label, source) pairs (each with `hub` and `licence`) into their local_dir,
    skipping the ones verified before; check_files(label, source, files) may refuse a plan before anything
    is written. Returns the records by local_dir. Offline, checks the recorded files instead."""
    if offline():
        return verify_offline(sources, log, check_files)
    api = hub_api()
    todo, records, done_bytes = [], {}, 0
    for label, source in sources:
        plan = plan_source(api, label, source)
        if check_files is not None:
            check_files(label, source, plan["files"])
        local_dir = source["hub"]["local_dir"]
        record = records.setdefault(local_dir, read_record(local_dir))
        record.setdefault("sources", {})[source["name"]] = {
            "repo": source["hub"]["repo"],
            "revision": source["hub"]["revision"],
            "commit": plan["commit"],
            "licence": source["licence"],
            "licence_on_hub": plan["licence_on_hub"],
            "files": [entry["path"] for entry in plan["files"]],
        }
        for entry in plan["files"]:
            path = local_path(source, entry)
            if is_verified(path, entry, record):
                done_bytes += entry["size"]
                continue
            if os.path.isfile(path):  # there, not recorded (a kill after the move): verify it in place
                got = checksum_of(path, entry)
                if got == expected(entry):
                    record["files"][entry["path"]] = {
                        "checksum": got, "size": os.path.getsize(path), "mtime_ns": os.stat(path).st_mtime_ns
                    }  # fmt: skip
                    done_bytes += entry["size"]
                    continue
                log(f"download: {path}: checksum differs from the Hub's; fetching it again")
            todo.append((source, label, entry | {"commit": plan["commit"]}))
        total = sum(entry["size"] for entry in plan["files"])
        log(
            f"download: {source['name']}: {source['hub']['repo']}@{plan['commit'][:12]}, {len(plan['files'])} "
            f"file(s), {size_text(total)} (licence: {source['licence']}; on the Hub: {plan['licence_on_hub']})"
        )
    for local_dir, record in records.items():
        os.makedirs(local_dir, exist_ok=True)
        write_json(os.path.join(local_dir, RECORD), record)
    if not todo:
        log(f"download: up to date ({size_text(done_bytes)} verified)")
        return records
    check_space(todo)
    fetch_all(workers, todo, records, log)
    return records


def verify_offline(sources, log=print, check_files=None):
    """The files each source's last download recorded, checked on disk without asking any server: a file
    untouched since (size and mtime as recorded) is taken as it is, any other (copied from another machine)
    is read and its checksum compared with the recorded one. The records are written back (new mtimes)
    only once every file has passed."""
    records, total, rehashed = {}, 0, 0
    for label, source in sources:
        hub = source["hub"]
        local_dir = hub["local_dir"]
        record = records.setdefault(local_dir, read_record(local_dir))
        record_path = os.path.join(local_dir, RECORD)
        what = f"{label}.hub: {hub['repo']}@{hub['revision']}"
        fetched = record.get("sources", {}).get(source["name"])
        if fetched is None or (fetched["repo"], fetched["revision"]) != (hub["repo"], hub["revision"]):
            raise DataError(
                f"{what}: offline (HF_HUB_OFFLINE) and {record_path} records no download of it; download it "
                f"where the Hub can be reached and copy {local_dir}/ here (with its {RECORD})"
            )
        outside = [name for name in fetched["files"] if not fnmatch.fnmatchcase(name, hub["files"])]
        if outside:
            raise DataError(
                f"{what}: offline, {record_path} holds {outside[0]}, which hub.files {hub['files']!r} does not "
                "ask for; download again where the Hub can be reached"
            )
        entries = []
        for name in fetched["files"]:
            path = os.path.join(local_dir, name)
            seen = record["files"].get(name)
            if seen is None:
                raise DataError(f"{path}: offline and no checksum of it in {record_path}; download it again")
            if not os.path.isfile(path):
                raise DataError(
                    f"{path}: missing (offline: HF_HUB_OFFLINE); copy it from the machine that downloaded it"
                )
            kind = "sha256" if len(seen["checksum"]) == 64 else "git_sha1"  # 40 hex digits: git's blob sha1
            entry = {"path": name, "size": seen["size"], kind: seen["checksum"]}
            if not is_verified(path, entry, record):
                got = checksum_of(path, entry)
                if got != seen["checksum"]:
                    raise DataError(
                        f"{path}: checksum {got[:12]}… differs from {seen['checksum'][:12]}… recorded in "
                        f"{record_path} (offline: nothing is fetched again); copy the file again"
                    )
                record["files"][name] = {"checksum": got, "size": os.path.getsize(path),
                                         "mtime_ns": os.stat(path).st_mtime_ns}  # fmt: skip
                rehashed += 1
            entries.append(entry)
            total += seen["size"]
        if check_files is not None:
            check_files(label, source, entries)
    for local_dir, record in records.items():
        if rehashed:
            write_json(os.path.join(local_dir, RECORD), record)
    log(f"download: offline (HF_HUB_OFFLINE): {size_text(total)} of recorded files verified here, "
        f"{rehashed} by their checksum; no server asked")  # fmt: skip
    return records


def fetch_all(workers, todo, records, log):
    """The files left, on `workers` threads, with one bar (bytes, files, rate, time left)."""
    size = sum(entry["size"] for _, _, entry in todo)
    log(f"download: {len(todo)} file(s), {size_text(size)} to fetch on {workers} worker(s)")
    bar = tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024, desc="download", mininterval=1.0)
    bar.set_postfix_str(f"0/{len(todo)} files")
    finished = 0
    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = {
                pool.submit(fetch_and_verify, source, label, entry["commit"], entry, bar): (source, entry)
                for source, label, entry in todo
            }
            for future in concurrent.futures.as_completed(futures):
                source, entry = futures[future]
                try:
                    verified = future.result()
                except DataError:
                    for other in futures:
                        other.cancel()
                    raise
                local_dir = source["hub"]["local_dir"]
                records[local_dir]["files"][entry["path"]] = verified
                write_json(os.path.join(local_dir, RECORD), records[local_dir])  # kept if killed now
                finished += 1
                bar.set_postfix_str(f"{finished}/{len(todo)} files")
    finally:
        bar.close()
    log(f"download: {finished} file(s) fetched and verified")


def check_path_glob(label, source, files):
    """The source's `path` must read what its hub fetches, or the corpus step would miss files."""
    missing = [
        entry["path"] for entry in files if not glob_matches(source["path"], local_path(source, entry))
    ]
    if missing:
        raise DataError(
            f"{label}.path: {source['path']!r} does not match "
            f"{local_path(source, {'path': missing[0]})} (hub.local_dir + the file's path in the dataset); "
            f"e.g. path: {os.path.join(source['hub']['local_dir'], source['hub']['files'])}"
        )


def glob_matches(pattern, path):
    if not glob.has_magic(pattern):
        return os.path.normpath(pattern) == os.path.normpath(path)
    return fnmatch.fnmatchcase(os.path.normpath(path), os.path.normpath(pattern))


def report_lines(sources):
    """Markdown lines for a report: each Hub source's dataset, commit, files and both licences, as the
    download recorded them (nothing when no source names a Hub dataset)."""
    lines = []
    for _, source in hub_sources(sources):
        record = read_record(source["hub"]["local_dir"]).get("sources", {}).get(source["name"])
        if record is None:
            lines.append(f"- {source['name']}: {source['hub']['repo']}, not downloaded")
            continue
        lines.append(
            f"- {source['name']}: {record['repo']}@{record['commit']}, {len(record['files'])} file(s); "
            f"licence: {record['licence']} (on the Hub: {record['licence_on_hub']})"
        )
    return ["## Hub sources", "", *lines, ""] if lines else []
