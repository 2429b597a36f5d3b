"""`pip install --no-build-isolation ./python` with the built module in place (what `make python`
does), offline, into a folder of its own: the installed package, not the source tree, loads a
model and generates."""
import os
import shutil
import subprocess
import sys

from conftest import MODELS, ROOT


def test_pip_installs_the_package_offline_and_it_runs(tmp_path, tiny):
    import recur
    model, tokenizer = tiny
    expected = [r.token for r in recur.stream_generate(model, tokenizer, [1, 2, 3], max_tokens=4)]
    module = sys.modules["recur.generate"]._recur.__file__  # the module under test
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "python"), src,
                    ignore=shutil.ignore_patterns("__pycache__", "_recur*.so", "build", "*.egg-info"))
    shutil.copy(module, src / "recur")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                           "--no-index", "--quiet", "--target", str(site), str(src)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    code = ("import recur, sys; print(recur.__file__); "
            f"m, t = recur.load({os.path.join(MODELS, 'qwen3next-tiny')!r}, kv_cache_mb=8); "
            "print([r.token for r in recur.stream_generate(m, t, [1, 2, 3], max_tokens=4)])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0].startswith(str(site)), lines
    assert lines[1] == str(expected)
