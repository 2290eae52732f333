"""The default bundle is built once however many processes ask for it at the same time: the others wait for
the first (saying so) and use what it built."""
import os
import subprocess
import sys
import time

# one process asking for the default bundle, "built" here by copying a tiny bundle into place (an export
# writes beside the folder and moves it in the same way): the build says it started, then waits for the
# test's go-ahead, so that the other process is known to be waiting meanwhile
ASK = """
import shutil, sys, time
from pathlib import Path
from edgespec.defaults import ensure_default_bundle

source, builds, go = sys.argv[1:4]

def build(path):
    with open(builds, "a") as f:
        f.write("built\\n")
    deadline = time.time() + 120
    while not Path(go).exists() and time.time() < deadline:
        time.sleep(0.05)
    shutil.copytree(source, path.with_name(".staged"))
    path.with_name(".staged").rename(path)

print(ensure_default_bundle(build))
"""


def test_two_processes_asking_at_once_build_the_default_bundle_once(bundle_factory, tmp_path):
    builds, go = tmp_path / "builds.txt", tmp_path / "go"
    env = {**os.environ, "EDGESPEC_CACHE": str(tmp_path / "cache")}
    ask = [sys.executable, "-c", ASK, str(bundle_factory()), str(builds), str(go)]
    first = subprocess.Popen(ask, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not builds.exists():  # the first holds the lock and builds
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.05)
        second = subprocess.Popen(ask, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        waiting = second.stderr.readline()  # blocks until the second says something: that it waits
        assert "another process is building the default bundle" in waiting and "waiting" in waiting, waiting
        go.touch()
        out_second, err_second = second.communicate(timeout=300)
        out_first, err_first = first.communicate(timeout=300)
    finally:
        for process in (first, locals().get("second")):
            if process is not None and process.poll() is None:
                process.kill()
    assert first.returncode == 0 and second.returncode == 0, err_first[-2000:] + err_second[-2000:]
    bundle = out_first.strip()
    assert out_second.strip() == bundle and os.path.isfile(os.path.join(bundle, "manifest.json"))
    assert builds.read_text() == "built\n"  # once: the second used what the first built
    assert "building the default bundle once" in err_first and "building" not in err_second
    assert "Traceback" not in err_first + err_second + waiting
