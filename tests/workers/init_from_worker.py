"""Build the model parts the trainer builds (any layout, checkpoint.init_from or a fresh init) and
report, per rank, what the build left in memory and on which devices.

Run under torchrun (or as one process) with the trainer's overrides; rank 0 writes a JSON list
(one entry per rank) to argv[1]. Each entry: the host memory before and during the build
(VmHWM, the peak resident set, reset just before the build; RssAnon sampled every 2 ms, which
excludes file pages such as a memory-mapped safetensors file), the devices of every parameter and
buffer, a hash of every full tensor of the checkpoint (layers compared across layouts), and with
init_from the largest difference between each full tensor and the Hugging Face file's (read
again here, after the measurement, by every rank).
"""

import hashlib
import json
import sys
import threading
import time

import torch

from lingua import config
from lingua.parallel import distributed
from lingua.train import build


def status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


class AnonPeak(threading.Thread):
    """The largest RssAnon seen while running (anonymous memory: copies, not mapped files)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.stop = status()["RssAnon"], threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, status()["RssAnon"])
            time.sleep(0.002)


def app_of(name: str):
    if name == "moe":
        from apps.moe import train
        return "moe", train
    from apps.llama import train
    return "llama", train


def main(out_path, app_name, argv):
    name, train = app_of(app_name)
    args = config.load(name, train.TrainArgs, argv, train.validate)
    env = distributed.init(args.distributed)
    distributed.barrier(env)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = status()
    sampler = AnonPeak()
    sampler.start()
    parts, _ = build.build_model_parts(args, env, train.APP)
    sampler.stop.set()
    sampler.join()
    after = status()
    mine = {"rank": env.rank, "before": before, "after": after, "peak_rss": after["VmHWM"],
            "peak_anon": sampler.peak,
            "local_bytes": sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
                               for part in parts for t in part.parameters()),
            "devices": sorted({str(t.to_local().device if hasattr(t, "to_local") else t.device)
                               for part in parts
                               for t in list(part.parameters()) + list(part.buffers())})}
    want = (train.APP.load_hf(args.checkpoint.init_from)[0].state_dict()
            if args.checkpoint.init_from else None)
    mine["hashes"], mine["max_diff"] = {}, {}
    for part in parts:
        for key, value in part.state_dict().items():
            full = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().cpu()
            data = full.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            mine["hashes"][key] = hashlib.blake2b(data, digest_size=16).hexdigest()
            if want is not None:
                mine["max_diff"][key] = (full.float() - want[key].float()).abs().max().item()
    everyone = [None] * env.world_size
    if env.world_size > 1:
        torch.distributed.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    if env.is_main:
        with open(out_path, "w") as f:
            json.dump(everyone, f)
    distributed.destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
    distributed.exit_process(0)  # results are written; gloo can abort interpreter teardown
