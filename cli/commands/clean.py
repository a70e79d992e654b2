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


def _leftovers(cache_path: str, work_dir: str) -> list[tuple[str, str]]:
    """``(what, path)`` of each thing ``clean`` removes that exists."""
    found = []
    units, ledgers, _ = work.usage(work_dir)
    if ledgers or fs.exists(fs.join(work_dir, work.PLAN_NAME)):
        kept = " kept for a grown corpus" if fs.exists(fs.join(work_dir, work.PLAN_NAME)) else ""
        found.append((f"work folder{kept}: {common.plural(units, 'work unit')} complete, {ledgers - units} begun",
                      work_dir))
    if fs.isdir(cache_path) and not fs.exists(fs.join(cache_path, fmt.MANIFEST_NAME)):
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
              "(default CACHE_PATH's sibling .SPLIT.work).")
@click.option("--dry-run", is_flag=True, help="Say what would be removed, and its size; remove nothing.")
def clean(cache_path, args, work_dir, dry_run):
    """Remove a cache's work folder and what builds that died left beside it.

    CACHE_PATH is CACHE_DIR/TASK/SPLIT, as build writes it. A complete cache
    (its manifest) is left as it is; a build running on it is waited for by
    no one: clean refuses in one line while it holds the cache's lock.
    """
    common.filesystem_options(args)
    work_dir = work_dir or work.work_path(cache_path)
    try:
        with build.cache_lock(cache_path):
            found = _leftovers(cache_path, work_dir)
            if not found:
                click.echo(f"nothing to remove beside {cache_path}")
                return
            for what, path in found:
                size = _tree_bytes(path)
                if not dry_run:
                    (writer.remove_cache_tree if path != work_dir else work.remove)(path)
                verb = "would remove" if dry_run else "removed"
                click.echo(f"{verb} {path}: {what}, {size / 1e6:,.1f} MB")
    except BuildError as e:
        common.fail(e)
