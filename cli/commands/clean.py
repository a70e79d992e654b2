"""``seqcache clean``: remove what builds of a cache keep beside it: its work
folder (units read and tokenized, kept for a rerun or for a grown corpus),
and what a build that died left (a folder without manifest, a staged
replacement). A complete cache is never touched."""

from __future__ import annotations

import os

import click

from seqcache import format as fmt
from seqcache import fs
from seqcache.cli.commands import common
from seqcache.pipelines import BuildError, build, work, writer


def _tree_bytes(path: str) -> int:
    """Bytes of every file under ``path`` (0 when there is none)."""
    if fs.is_local(path):
        total = 0
        for root, _, names in os.walk(fs.local_path(path)):
            for name in names:
                try:
                    total += os.path.getsize(os.path.join(root, name))
                except OSError:
                    pass
        return total
    return sum(f.num_bytes for f in fs.match(path.rstrip("/") + "/**"))


# What a build writes in a cache folder: the only names ``clean`` removes a folder without a manifest for.
_BUILD_NAMES = (fmt.DATA_PREFIX, fmt.PROVENANCE_PREFIX, "vocabulary-", fmt.QUARANTINE_NAME, fmt.SHARD_CHECKSUMS_NAME,
                fmt.SOURCE_TABLE_NAME, ".tmp-")


def _foreign(folder: str) -> str | None:
    """The first entry of ``folder`` that no build writes there (a file of
    another name, a folder but ``_tmp``), or None."""
    if fs.is_local(folder):
        entries = [(e.name, e.is_dir()) for e in os.scandir(fs.local_path(folder))]
    else:
        prefix = folder.rstrip("/") + "/"
        names = {f.path[len(prefix):] for f in fs.match(prefix + "**") if f.path.startswith(prefix)}
        entries = [(n.split("/", 1)[0], "/" in n) for n in names]
    for name, is_dir in sorted(entries):
        if is_dir and name != writer.TMP_DIR_NAME or not is_dir and not name.startswith(_BUILD_NAMES):
            return f"{name}/" if is_dir else name
    return None


def _leftovers(cache_path: str, work_dir: str, *, with_cache: bool = True) -> list[tuple[str, str]]:
    """``(what, path)`` of each thing ``clean`` removes that exists: the work
    folder, and (``with_cache``) what builds that died left beside the cache."""
    found = []
    units, ledgers, _ = work.usage(work_dir)
    if fs.isdir(work_dir):  # a folder half removed (a build killed while removing it) too
        stray = work.foreign_entry(work_dir)
        if stray is not None:
            raise click.ClickException(f"{work_dir} is not a work folder: it holds {stray}, which no build writes "
                                       "there; clean removes nothing")
        kept = " kept for a grown corpus" if fs.exists(fs.join(work_dir, work.PLAN_NAME)) else ""
        found.append((f"work folder{kept}: {common.plural(units, 'work unit')} complete, {ledgers - units} begun",
                      work_dir))
    if not with_cache:
        return found
    if fs.isdir(cache_path) and not fs.exists(fs.join(cache_path, fmt.MANIFEST_NAME)):
        foreign = _foreign(cache_path)
        if foreign is not None:
            raise click.ClickException(
                f"{cache_path} is neither a cache folder (CACHE_DIR/TASK/SPLIT) nor what a build of one left: it "
                f"holds {foreign}, which no build writes; clean removes nothing (give the cache's own folder)")
        found.append(("a build that did not finish (no manifest)", cache_path))
    elif fs.exists(fs.join(cache_path, writer.TMP_DIR_NAME)):
        found.append(("the working files of a build that ended while writing the manifest",
                      fs.join(cache_path, writer.TMP_DIR_NAME)))
    for what, path in (("a replacement that did not finish (--overwrite)", writer.staging_path(cache_path)),
                       ("the old cache of a replacement that did not finish", writer.replaced_path(cache_path))):
        if fs.isdir(path):
            found.append((what, path))
    return found


@click.command("clean", context_settings=common.BEAM_OPTIONS_CONTEXT, epilog=common.BEAM_OPTIONS_EPILOG)
@click.argument("cache_path")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--work-dir", "work_dir", help="The work folder, where the builds were given --work-dir "
              "(default CACHE_PATH's sibling .SPLIT.work, and for a cache at a URL also the folder on this "
              "machine that a build running its steps here uses).")
@click.option("--dry-run", is_flag=True, help="Say what would be removed, and its size; remove nothing.")
def clean(cache_path, args, work_dir, dry_run):
    """Remove a cache's work folder and what builds that died left beside it.

    CACHE_PATH is CACHE_DIR/TASK/SPLIT, as build writes it. A complete cache
    (its manifest) is left as it is; a build running on it is waited for by
    no one: clean refuses in one line while it holds the cache's lock.
    """
    common.filesystem_options(args)
    # A cache at a URL built on this machine keeps its work here (work.work_path): both places are looked at.
    # A mixture's tasks keep theirs in --work-dir/<task>.
    task = cache_path.rstrip("/").rsplit("/", 2)[-2] if cache_path.rstrip("/").count("/") else None
    work_dirs = ([w for w in (work_dir, fs.join(work_dir, task) if task else None) if w] if work_dir else
                 [work.work_path(cache_path), work.work_path(cache_path, steps_run_here=True)])
    work_dirs = list(dict.fromkeys(work_dirs))
    try:
        with build.cache_lock(cache_path, advice="wait for it to finish, then clean"):
            found = [item for w in work_dirs for item in _leftovers(cache_path, w, with_cache=w == work_dirs[0])]
            if not found:
                click.echo(f"nothing to remove beside {cache_path}")
                return
            for what, path in found:
                size = _tree_bytes(path)
                if not dry_run:
                    (work.remove if path in work_dirs else writer.remove_cache_tree)(path)
                verb = "would remove" if dry_run else "removed"
                click.echo(f"{verb} {path}: {what}, {size / 1e6:,.1f} MB")
    except BuildError as e:
        common.fail(e)
    except OSError as e:  # a path the file system refuses (too long)
        common.fail(e)
