"""L3 through two engines in separate processes: the C++ trainer side (packed, vocab-parallel TP=2,
trainer entry) and the Python rollout side (tools/l3_rollout.py: one row at a time through this
binding's serving entry) give identical logp and lse bytes on the golden cases."""
import subprocess
import sys

from conftest import ROOT

CASES = "tiny-v17,v17-i32-ignore7,v2053-bias-t0.7,v2053-trows-serving,v2112-real2053-t1.3"
CPU = "cpu-linear-logp-contract-v1"


def test_python_rollout_side_matches_the_cpp_trainer_side(cli, tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    subprocess.run([cli, "harness", "l3-export", "--dir", str(inputs), "--case", CASES], check=True)
    trainer, rollout = tmp_path / "trainer.safetensors", tmp_path / "rollout.safetensors"
    subprocess.run([cli, "harness", "l3", "--side", "trainer", "--tp", "2", "--strict", "--backend", CPU,
                    "--case", CASES, "--out", str(trainer)], check=True)  # fmt: skip
    subprocess.run([sys.executable, str(ROOT / "tools" / "l3_rollout.py"), "--inputs", str(inputs),
                    "--out", str(rollout), "--strict", "--backend", CPU], check=True)  # fmt: skip
    check = subprocess.run([cli, "harness", "l3-check", "--a", str(trainer), "--b", str(rollout)],
                           capture_output=True, text=True)  # fmt: skip
    print(check.stdout)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "producer detlogp-python" in check.stdout and "producer detlogp-cli" in check.stdout
    assert check.stdout.count(" PASS ") == len(CASES.split(","))
    assert "verdict: PASS" in check.stdout
