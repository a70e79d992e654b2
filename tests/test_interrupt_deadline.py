"""An interrupted command whose shutdown hangs still ends: after the grace
period it kills its worker processes, says so and exits with 130 (143 after
SIGTERM)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from testsupport import default_signals

CHILD = textwrap.dedent("""
    import os, subprocess, sys, time
    from seqcache.cli import interrupts

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with interrupts.handled(on_deadline=lambda: os.write(2, b"gave up waiting\\n"), grace_s=1.0):
        try:
            print(worker.pid, flush=True)  # the handlers are in place
            time.sleep(600)
        except KeyboardInterrupt:
            time.sleep(600)  # a shutdown that never finishes
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_hanging_shutdown_ends_after_the_grace_period(tmp_path):
    for signum in (signal.SIGINT, signal.SIGTERM):
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=tmp_path, preexec_fn=default_signals)
        worker = int(proc.stdout.readline())
        assert _alive(worker)
        proc.send_signal(signum)
        start = time.monotonic()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signum, err  # 130, 143
        assert err == "gave up waiting\n"
        assert 0.9 <= time.monotonic() - start < 30
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker)


def test_a_quick_shutdown_is_not_cut_short(tmp_path):
    quick = CHILD.replace("time.sleep(600)  # a shutdown that never finishes", "sys.exit(7)")
    proc = subprocess.Popen([sys.executable, "-c", quick], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, preexec_fn=default_signals)
    worker = int(proc.stdout.readline())
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 7 and err == ""
    os.kill(worker, signal.SIGKILL)


def test_an_interrupt_during_start_up_exits_130(tmp_path):
    """A command interrupted before it reports interrupts itself (here: while its
    module loads) exits with 130, not click's "Aborted!" and 1."""
    (tmp_path / "slow_tasks.py").write_text("import time\nprint('loading', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-m", "seqcache.cli", "build", "--module", "slow_tasks", "x",
                             "--cache-dir", str(tmp_path / "c")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, preexec_fn=default_signals)
    assert proc.stdout.readline() == "loading\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted"


REDIRECTED = textwrap.dedent("""
    import os, sys, time
    from seqcache.cli import interrupts
    from seqcache.cli.commands import common

    with common.worker_stderr(verbose=False) as stderr:  # descriptor 2 taken from Beam's workers
        os.write(2, b"a worker's noise\\n")
        with interrupts.handled(on_deadline=lambda: common.write_stderr("gave up waiting\\n"), grace_s=0.5):
            try:
                print("ready", flush=True)
                time.sleep(600)
            except KeyboardInterrupt:
                time.sleep(600)  # a shutdown that never finishes
""")


def test_the_deadline_message_reaches_stderr_while_workers_output_is_hidden(tmp_path):
    """A build hides descriptor 2 from Beam's workers; the message of a shutdown
    that ran out of time, written from the timer's thread, still reaches the
    real standard error, and the workers' output does not."""
    proc = subprocess.Popen([sys.executable, "-c", REDIRECTED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, preexec_fn=default_signals)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err == "gave up waiting\n"


def test_an_interrupt_after_a_hidden_stderr_block_still_says_so(tmp_path):
    """An interrupt that escapes the block which hid descriptor 2 leaves it
    hidden (Beam's teardown still writes); the command's "interrupted" is
    written to the real standard error."""
    child = textwrap.dedent("""
        import sys
        from seqcache.cli import main as cli
        from seqcache.cli.commands import common

        @cli.main.command("hide-and-interrupt")
        def hide_and_interrupt():
            with common.worker_stderr(verbose=False):
                raise KeyboardInterrupt

        sys.argv = ["seqcache", "hide-and-interrupt"]
        cli.main()
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "interrupted\n"
