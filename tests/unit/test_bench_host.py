"""The bench's host section: the facts that move every figure (the CPU, the kernel and its
scheduler parameters), read from the files Linux gives them in, and nothing made up when a file
is missing or says something else."""

from __future__ import annotations

import platform

from transferd.tools.bench.plan import cpu_model, host, sched_params
from transferd.tools.bench.report import table_header

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 167
model name\t: Intel(R) Xeon(R) Processor
stepping\t: 1

processor\t: 1
model\t\t: 168
model name\t: Other
"""


def test_cpu_model_takes_the_first_processor_with_its_model_number() -> None:
    assert cpu_model(CPUINFO) == "Intel(R) Xeon(R) Processor (model 167)"
    assert cpu_model("model name\t: Neoverse-V2\n") == "Neoverse-V2"  # no model line (some arm64 kernels)
    assert cpu_model("processor\t: 0\nBogoMIPS\t: 50.00\n") is None
    assert cpu_model(None) is None


def test_sched_params_are_the_kernels_and_stop_at_inits() -> None:
    cmdline = ("console=ttyS0 quiet cpuidle_haltpoll.force=1 haltpoll.guest_halt_poll_ns=0 sched_vcpu_pack=15 "
               "isolcpus=2-3 nohz_full=2-3 idle=poll rdinit=/init -- --sched_x=1 idle=halt")
    assert sched_params(cmdline) == {"cpuidle_haltpoll.force": "1", "haltpoll.guest_halt_poll_ns": "0",
                                     "sched_vcpu_pack": "15", "isolcpus": "2-3", "nohz_full": "2-3", "idle": "poll"}
    assert sched_params("root=/dev/vda ro") == {}
    assert sched_params(None) == {}


def test_host_names_this_machine_and_the_table_says_it() -> None:
    h = host()
    assert h["kernel"] == platform.release() and h["cpus"] >= 1
    assert h["cpus_allowed"] is None or 1 <= h["cpus_allowed"] <= h["cpus"]
    assert isinstance(h["kernel_sched_params"], dict)
    out = {"host": {**h, "loadavg_before": [0.0, 0.0, 0.0], "cpu_model": "Xeon (model 167)",
                    "kernel_sched_params": {"sched_vcpu_pack": "15", "isolcpus": ""}, "cpuidle_driver": "haltpoll",
                    "tcp_congestion_control": "bbr"},
           "quick": True, "repeats": 5}
    header = table_header(out)
    assert header[0].startswith("transferd bench (quick): 5 interleaved rounds")
    assert header[1] == f"Xeon (model 167); kernel {h['kernel']} (sched_vcpu_pack=15 isolcpus); cpuidle haltpoll; TCP bbr"
    # a JSON from before these facts (or a host without them) keeps the one line it had
    old = {**out, "host": {k: v for k, v in out["host"].items() if k not in ("kernel", "cpu_model")}}
    assert len(table_header(old)) == 1
