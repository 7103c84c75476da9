"""`benchmarks.peers` and its llama.cpp helpers: the request each llama.cpp call sends, the server's
command line, CPU time read from /proc for a real child process, the ratio and goal arithmetic on
numbers worked by hand, and (slow, only where llama-server is already built: building it takes 7-17
minutes) the whole benchmark on a tiny workload."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from benchmarks import llama_cpp, peers, same_gguf


def test_each_request_enables_its_own_adapter_and_zeroes_the_rest() -> None:
    assert llama_cpp.lora_scales(2, 4) == [
        {"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}, {"id": 2, "scale": 1.0}, {"id": 3, "scale": 0.0},
    ]
    assert [entry["scale"] for entry in llama_cpp.lora_scales(None, 3)] == [0.0, 0.0, 0.0]


def test_completion_body_is_greedy_uncached_and_of_fixed_length() -> None:
    body = llama_cpp.completion_body([5, 6, 7], new_tokens=64, adapter_idx=1, num_adapters=2)
    assert body == {"prompt": [5, 6, 7], "n_predict": 64, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
                    "repeat_penalty": 1.0, "cache_prompt": False,
                    "lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]}
    assert "lora" not in llama_cpp.completion_body([5], new_tokens=3, adapter_idx=None, num_adapters=0)


def _flag_values(command: list[str], flag: str) -> list[str]:
    return [command[i + 1] for i, word in enumerate(command) if word == flag]


def test_server_command_sizes_every_slot_and_loads_adapters_unapplied() -> None:
    loras = [Path("/a.gguf"), Path("/b.gguf")]
    command = llama_cpp.server_command(Path("/bin/llama-server"), Path("/m.gguf"), loras, port=8123,
                                       num_slots=64, slot_context_tokens=60 + 64, threads=1)
    # 124 tokens a slot, rounded up to llama.cpp's 256 per slot: 64 * 256.
    assert _flag_values(command, "-c") == ["16384"] and _flag_values(command, "-np") == ["64"]
    assert _flag_values(command, "-t") == ["1"] and _flag_values(command, "-tb") == ["1"]
    assert _flag_values(command, "--lora") == ["/a.gguf", "/b.gguf"] and command[-1] == "--lora-init-without-apply"
    bare = llama_cpp.server_command(Path("/s"), Path("/m"), [], port=1, num_slots=2, slot_context_tokens=257, threads=3)
    assert _flag_values(bare, "-c") == [str(2 * 512)]
    assert "--lora" not in bare and "--lora-init-without-apply" not in bare


BURN_TWO_THREADS = textwrap.dedent("""
    import sys, threading, time
    def burn(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
    helper = threading.Thread(target=burn, args=(0.3,))
    helper.start()
    burn(0.3)
    helper.join()
    print(time.process_time(), flush=True)
    sys.stdin.read()
""")


def test_cpu_seconds_from_proc_stat_count_every_thread_of_a_real_process(tmp_path: Path) -> None:
    """The child names itself with spaces and parentheses (the command name field may hold both) and
    burns CPU on two threads; its own process_time is the oracle."""
    executable = tmp_path / "peer (x) y"
    executable.symlink_to(sys.executable)
    child = subprocess.Popen([str(executable), "-c", BURN_TWO_THREADS], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        reported = float(child.stdout.readline())
        stat_line = Path(f"/proc/{child.pid}/stat").read_text()
        measured = llama_cpp.process_cpu_seconds(child.pid)
    finally:
        child.communicate("")
    assert "(peer (x) y)" in stat_line
    assert reported >= 0.6
    assert measured == pytest.approx(reported, abs=0.05)  # /proc counts in clock ticks (10 ms)


def test_stat_cpu_seconds_reads_utime_and_stime_after_the_command_name() -> None:
    fields_after_name = "S 1 2 3 4 5 6 7 8 9 10 150 50 7 7"  # utime 150, stime 50 ticks; children's ignored
    assert llama_cpp.stat_cpu_seconds(f"42 (a) b ) c) {fields_after_name}", ticks_per_s=100) == 2.0


def test_server_that_exits_dies_with_its_status_and_output(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import sys; print('no model here', file=sys.stderr); sys.exit(3)"]
    server = llama_cpp.LlamaServer(command, llama_cpp.free_port())
    with pytest.raises(llama_cpp.PeerDied) as died, server:
        pass
    assert died.value.reason == "llama-server exited with status 3" and died.value.log_tail == "no model here"
    assert server.process.returncode == 3


def test_server_killed_by_a_signal_is_named_with_its_last_lines() -> None:
    """The process prints more lines than the report keeps, then dies of SIGILL, as llama-server did on
    an AMX CPU."""
    command = [sys.executable, "-c", "import os, signal\nfor i in range(30): print('line', i, flush=True)\n"
               "os.kill(os.getpid(), signal.SIGILL)"]
    server = llama_cpp.LlamaServer(command, llama_cpp.free_port())
    with pytest.raises(llama_cpp.PeerDied) as died, server:
        pass
    assert died.value.reason == "llama-server killed by SIGILL"
    assert died.value.log_tail.splitlines() == [f"line {i}" for i in range(30 - llama_cpp.LOG_TAIL_LINES, 30)]


def test_exit_reasons_in_words() -> None:
    assert llama_cpp.exit_reason(0) == "exited with status 0"
    assert llama_cpp.exit_reason(-9) == "killed by SIGKILL"
    assert llama_cpp.exit_reason(-200) == "killed by signal 200"  # no such signal: its number


def _die_script(tmp_path: Path) -> Path:
    """An executable that, given a server's command line, prints its model and kills itself with SIGILL."""
    script = tmp_path / "dying-server"
    script.write_text('#!/bin/sh\necho "loading model $2"\nkill -s ILL $$\n')
    script.chmod(0o755)
    return script


def _tiny_workload(tmp_path: Path) -> peers.Workload:
    return peers.Workload(prompts=[[1, 2, 3], [4, 5]], adapter_paths=[tmp_path / "adapter"], adapter_of=[0, 0],
                          new_tokens=2)


def test_a_server_that_dies_is_recorded_per_workload_and_the_others_still_run(tmp_path: Path) -> None:
    model = tmp_path / "model-q8_0.gguf"
    report = peers.measure_llama_cpp_file(_die_script(tmp_path), model, [tmp_path / "a.gguf"],
                                          _tiny_workload(tmp_path), threads=1)
    expected = {"died": "llama-server killed by SIGILL", "log_tail": f"loading model {model}"}
    assert report == {"W": expected, "base": expected, "base_1": expected}


def test_real_llama_server_on_a_file_it_cannot_read_is_recorded(tmp_path: Path) -> None:
    binary = llama_cpp.server_binary(llama_cpp.llama_cpp_root())
    if not llama_cpp.is_built(binary):
        pytest.skip("llama-server is not built in the cache (python -m benchmarks.peers builds it, 7-17 minutes)")
    model = tmp_path / "truncated.gguf"
    model.write_bytes(b"GGUF\x03\x00")
    report = peers.measure_llama_cpp_file(binary, model, [], _tiny_workload(tmp_path), threads=1)
    assert {run["died"] for run in report.values()} == {"llama-server exited with status 1"}
    assert "truncated.gguf" in report["base_1"]["log_tail"]


DYING_ON_COMPLETION = textwrap.dedent("""
    import http.server, os, signal, sys
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
        def do_POST(self):
            print('computing', flush=True)
            os.kill(os.getpid(), signal.SIGILL)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")


def test_a_server_dying_in_a_burst_is_named_by_its_signal() -> None:
    port = llama_cpp.free_port()
    with llama_cpp.LlamaServer([sys.executable, "-c", DYING_ON_COMPLETION, str(port)], port) as server:
        with pytest.raises(llama_cpp.PeerDied) as died:
            llama_cpp.run_burst(server, [llama_cpp.completion_body([1], 2, None, 0)])
    assert died.value.reason == "llama-server killed by SIGILL" and died.value.log_tail.endswith("computing")


HEALTH_SERVER = textwrap.dedent("""
    import http.server, sys
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
""")


def test_server_is_used_once_healthy_and_always_terminated() -> None:
    port = llama_cpp.free_port()
    server = llama_cpp.LlamaServer([sys.executable, "-c", HEALTH_SERVER, str(port)], port)
    with server:
        assert server.process.poll() is None and server.cpu_seconds() > 0
    assert server.process.poll() is not None


def test_extraction_keeps_only_the_vendored_tree(tmp_path: Path) -> None:
    sdist = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        for name in ("vendor/llama.cpp/CMakeLists.txt", "vendor/llama.cpp/src/llama.cpp", "llama_cpp/__init__.py"):
            data = name.encode()
            member = tarfile.TarInfo(f"llama_cpp_python-0.3.36/{name}")
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    llama_cpp._extract_vendored(sdist, tmp_path / "out")
    files = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert files == ["CMakeLists.txt", "src/llama.cpp"]


def test_staged_model_dir_names_the_architecture_and_links_the_rest(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (model_dir / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "scratch").mkdir()
    staged = llama_cpp.stage_model_dir(model_dir, tmp_path / "scratch")
    config = json.loads((staged / "config.json").read_text())
    assert config == {"model_type": "llama", "hidden_size": 8, "architectures": ["LlamaForCausalLM"]}
    assert (staged / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((model_dir / "config.json").read_text()) == {"model_type": "llama", "hidden_size": 8}


def test_ratios_and_goals_on_hand_worked_numbers() -> None:
    ratios = peers.compute_ratios(ours_w=300.0, ours_base=330.0, llama_w=100.0, llama_base=250.0, peft_w=150.0)
    # 300/100 = 3.0 (goal >= 3: met at the threshold); 330/250 = 1.32 (< 1.5); 300/150 = 2.0 (< 2.5);
    # 330/300 - 1 = 10% (<= 15%).
    assert ratios == pytest.approx({"ours_vs_llama_cpp_w": 3.0, "ours_vs_llama_cpp_base": 1.32,
                                    "ours_vs_peft_w": 2.0, "lora_overhead": 0.1})
    met = {name: goal["met"] for name, goal in peers.check_goals(ratios).items()}
    assert met == {"ours_vs_llama_cpp_w": True, "ours_vs_llama_cpp_base": False, "ours_vs_peft_w": False,
                   "lora_overhead": True}


def test_goals_of_unmeasured_peers_are_unknown_not_failed() -> None:
    ratios = peers.compute_ratios(ours_w=100.0, ours_base=120.0, llama_w=None, llama_base=None, peft_w=None)
    goals = peers.check_goals(ratios)
    assert goals["ours_vs_peft_w"]["met"] is None and goals["ours_vs_llama_cpp_base"]["value"] is None
    assert goals["lora_overhead"] == {"comparison": "<=", "threshold": 0.15, "value": pytest.approx(0.2), "met": False}


def test_best_dtype_is_chosen_per_workload() -> None:
    runs = {"f32": {"W": {"tokens_per_cpu_s": 90.0}, "base": {"tokens_per_cpu_s": 200.0}},
            "bf16": {"W": {"tokens_per_cpu_s": 110.0}, "base": {"tokens_per_cpu_s": 180.0}}}
    assert peers.best_dtype(runs, "W") == "bf16" and peers.best_dtype(runs, "base") == "f32"
    assert peers.best_dtype({"float32": {"tokens_per_cpu_s": 5.0}, "bfloat16": {"tokens_per_cpu_s": 4.0}}) == "float32"
    assert peers.best_dtype({}) is None
    runs["bf16"]["W"] = {"died": "llama-server killed by SIGILL", "log_tail": ""}
    assert peers.best_dtype(runs, "W") == "f32"
    runs["f32"]["W"] = {"died": "llama-server exited with status 1", "log_tail": ""}
    assert peers.best_dtype(runs, "W") is None


@pytest.mark.slow
def test_peers_benchmark_end_to_end_on_a_tiny_workload() -> None:
    if not llama_cpp.is_built(llama_cpp.server_binary(llama_cpp.llama_cpp_root())):
        pytest.skip("llama-server is not built in the cache (python -m benchmarks.peers builds it, 7-17 minutes)")
    report = peers.main(["--num-requests", "2", "--new-tokens", "3", "--adapters", "1", "--skip-peft"])
    for outtype in ("f32", "bf16"):
        for workload in ("W", "base"):
            assert report["llama_cpp"][outtype][workload]["tokens"] == 2 * 3
            assert report["ours_gguf"][outtype][workload]["tokens"] == 2 * 3
        assert report["llama_cpp"][outtype]["base_1"]["tokens"] == report["ours_gguf"][outtype]["base_1"]["tokens"] == 3
    assert report["file_ratios"]["f32"]["base_1"]["bf16"] == pytest.approx(
        report["ours_gguf"]["f32"]["base_1"]["tokens_per_cpu_s"] / report["ours_gguf"]["bf16"]["base_1"]["tokens_per_cpu_s"])
    best_w = report["best_dtypes"]["llama_cpp_w"]
    expected = report["ours"]["W"]["tokens_per_cpu_s"] / report["llama_cpp"][best_w]["W"]["tokens_per_cpu_s"]
    assert report["ratios"]["ours_vs_llama_cpp_w"] == pytest.approx(expected)
    assert "peft" not in report and report["goals"]["ours_vs_peft_w"]["met"] is None


def test_same_file_ratios_against_llama_cpp_and_ours_at_bf16() -> None:
    def rates(w: float, base: float, base_1: float) -> dict:
        return {"W": {"tokens_per_cpu_s": w}, "base": {"tokens_per_cpu_s": base}, "base_1": {"tokens_per_cpu_s": base_1}}

    ours = {"bf16": rates(100.0, 200.0, 10.0), "q4_k_m": rates(150.0, 260.0, 30.0)}
    llama = {"q4_k_m": rates(50.0, 130.0, 20.0)}  # bf16 not run by llama.cpp
    ratios = same_gguf.file_ratios(ours | {"q5_k_m": {"refused": "Q5_1 is not supported"}}, llama)
    assert "q5_k_m" not in ratios
    assert ratios["q4_k_m"]["base_1"] == {"llama.cpp": pytest.approx(1.5), "bf16": pytest.approx(3.0)}
    assert ratios["q4_k_m"]["W"] == {"llama.cpp": pytest.approx(3.0), "bf16": pytest.approx(1.5)}
    assert ratios["bf16"]["base"] == {"bf16": pytest.approx(1.0)}
    goals = {(g["workload"], g["type"], g["over"]): g for g in same_gguf.check_file_goals(ratios)}
    assert goals[("base_1", "q4_k_m", "bf16")]["met"] is True  # 3.0 >= 2.5
    assert goals[("base", "q4_k_m", "llama.cpp")]["met"] is True  # 260 / 130 = 2.0 >= 1.5
    assert goals[("W", "q4_k_m", "llama.cpp")]["met"] is False  # 3.0 < 4
    assert goals[("base", "q8_0", "llama.cpp")] == {"workload": "base", "type": "q8_0", "over": "llama.cpp",
                                                     "threshold": 1.5, "value": None, "met": None}


def test_same_file_table_shows_rates_ratios_and_why_a_run_is_missing() -> None:
    died = {"died": "llama-server killed by SIGILL", "log_tail": "init"}
    ours = {"q8_0": {"W": {"tokens_per_cpu_s": 300.0}, "base": {"tokens_per_cpu_s": 400.0},
                     "base_1": {"tokens_per_cpu_s": 30.0}},
            "q4_k_m": {"refused": "Q5_0 is not supported"}}
    llama = {"q8_0": {"W": died, "base": {"tokens_per_cpu_s": 200.0}, "base_1": {"tokens_per_cpu_s": 40.0}},
             "q4_k_m": {"W": died, "base": died, "base_1": died}}
    ratios = same_gguf.file_ratios(ours, llama)
    assert ratios["q8_0"] == {"W": {}, "base": {"llama.cpp": pytest.approx(2.0)}, "base_1": {"llama.cpp": pytest.approx(0.75)}}
    rows = same_gguf.file_table(ours, llama, ratios, num_requests=32, num_adapters=8).splitlines()
    assert rows[2:] == [
        "| q8_0 | 1 request | 30.0 | 40.0 | 0.75x | - |",
        "| q8_0 | 32 requests | 400.0 | 200.0 | 2.00x | - |",
        "| q8_0 | 32 requests, 8 adapters | 300.0 | died: llama-server killed by SIGILL | - | - |",
        "| q4_k_m | 1 request | refused the file | died: llama-server killed by SIGILL | - | - |",
        "| q4_k_m | 32 requests | refused the file | died: llama-server killed by SIGILL | - | - |",
        "| q4_k_m | 32 requests, 8 adapters | refused the file | died: llama-server killed by SIGILL | - | - |",
    ]
