"""Sealing a dumped step: rank 0 writes step{S}/COMPLETE once every file of the step's generation is in
place (named with sizes and checksums), failing fast when a rank of this host died or reported a failed
write; the run's identity (rank 0's run id and every rank's host and pid) that makes this checkable."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .background import FAILED_MARKER
from .format import (
    CHECKSUM,
    COMPLETE,
    FULL_DIR,
    FULL_INDEX,
    HEADER_KEY,
    SAMPLED,
    CompleteRecord,
    file_crc32,
    header_crc32,
)
from .safe_io import HOST, process_alive, read_safetensors_header, remove_entry, write_json


def header_generation(path: Path) -> tuple[str | None, bytes]:
    """(the generation a gapmon safetensors file's header names, the raw header bytes), or
    (None, b"") if it cannot be read (yet)."""
    try:
        raw, meta = read_safetensors_header(path)
        return json.loads(meta[HEADER_KEY]).get("generation"), raw
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, b""


def _collective_device() -> torch.device:
    backend = str(dist.get_backend())
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def share_identity(run_id: str) -> tuple[str, list[tuple[str, int]]]:
    """Rank 0's run id, and (host, pid) of every rank: one all-gather of fixed-size byte tensors
    (no pickling, no numpy). The pids let rank 0 see a rank of its host die instead of waiting."""
    me = f"{run_id}\n{HOST}\n{os.getpid()}".encode()[:255]
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return run_id, [(HOST, os.getpid())]
    device = _collective_device()
    mine = torch.zeros(256, dtype=torch.uint8, device=device)
    mine[:len(me)] = torch.tensor(list(me), dtype=torch.uint8, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    fields = [bytes(t.cpu().tolist()).rstrip(b"\0").decode().split("\n") for t in everyone]
    return fields[0][0], [(host, int(pid)) for _, host, pid in fields]


def supersedes(found: str, generation: str) -> bool:
    """Whether generation id `found` is a later dump of the same run and step than `generation`."""
    head, _, count = found.rpartition(".")
    mine, _, my_count = generation.rpartition(".")
    return head == mine and count.isdigit() and my_count.isdigit() and int(count) > int(my_count)


def _remove_unlisted(directory: Path, listed: dict[str, Any]) -> None:
    """Removes the files an earlier generation of a step left that its new COMPLETE does not list
    (rank files of a larger world, another mode's files)."""
    tops = {name.split("/")[0] for name in listed}
    for path in directory.iterdir():
        name = path.name
        if name in tops:
            continue
        try:
            if name == FULL_DIR or name in (SAMPLED, FULL_INDEX) or (name.startswith("rank") and name.endswith(".safetensors")):
                remove_entry(path)  # a link is removed, never followed
        except OSError:
            pass



class StepSealer:
    """Writes a step's COMPLETE for the run `run_id` whose ranks are `peers` ((host, pid) each), waiting at
    most `timeout` seconds for the other ranks' files."""

    def __init__(self, run_id: str, peers: list[tuple[str, int]], timeout: float):
        self.run_id, self.peers, self.timeout = run_id, peers, timeout

    def complete(self, directory: Path, step: int, generation: str, expected: list[str], recorded: dict[str, Any],
                 gapmon_files: bool = True) -> None:
        """Writes COMPLETE (rank 0) once every expected file of `generation` is in place, naming
        them with their sizes and checksums. A gapmon safetensors file counts once its header names
        this generation (a file an earlier dump left under the same name does not): its tensors'
        checksums are in that header, and COMPLETE records the header's. Other files (DCP's) are
        checksummed whole. Fails fast when a rank of this host died or reported a failed write."""
        records: dict[str, dict[str, int]] = {}
        if not gapmon_files:
            for name in expected:
                path = directory / name
                records[name] = {"bytes": path.stat().st_size, CHECKSUM: file_crc32(path)}
        deadline = time.monotonic() + self.timeout
        missing = [name for name in expected if name not in records]
        while missing:
            for name in list(missing):
                found, raw = header_generation(directory / name)
                if found == generation:
                    records[name] = {"bytes": (directory / name).stat().st_size, f"header_{CHECKSUM}": header_crc32(raw)}
                    missing.remove(name)
                elif found is not None and supersedes(found, generation):
                    return  # this step was dumped again meanwhile: that newer generation completes it
            if not missing:
                break
            self.check_writers(directory, step, missing)
            if time.monotonic() > deadline:
                raise TimeoutError(f"GradientDumper: {directory} still lacks {missing} of this dump after "
                                   f"{self.timeout:.0f}s (a rank died or is stuck?); step left incomplete")
            time.sleep(0.01)
        write_json(directory / COMPLETE, CompleteRecord(records, step, self.run_id, generation, len(self.peers),
                                                        recorded).to_json())
        _remove_unlisted(directory, records)

    def peer_exited(self, rank: int) -> bool:
        """Whether rank `rank` is a process of this host (not this one) that no longer runs."""
        peer_host, pid = self.peers[rank] if rank < len(self.peers) else (None, 0)
        return peer_host == HOST and pid != os.getpid() and not process_alive(pid)

    def check_peers_alive(self, step: int) -> None:
        """Raises at once, naming the rank, if a rank of this host has exited: the collectives of the full
        and sampled modes would otherwise wait for it until the process group's timeout."""
        for rank, (_, pid) in enumerate(self.peers):
            if self.peer_exited(rank):
                raise RuntimeError(f"GradientDumper: rank {rank} (pid {pid}) has exited; step {step} is not dumped "
                                   "(its collectives would wait for it)")

    def check_writers(self, directory: Path, step: int, missing: list[str]) -> None:
        """Raises at once, naming the rank, if a rank whose file is missing reported a failed write
        or (a process of this host) is no longer running. Ranks on other hosts are waited for."""
        for name in missing:
            rank = int(name[len("rank"):-len(".safetensors")]) if name.startswith("rank") else 0
            marker = directory / FAILED_MARKER.format(f"rank{rank}")
            if marker.exists():
                raise RuntimeError(f"GradientDumper: rank {rank} failed to write step {step}: "
                                   f"{marker.read_text(errors='replace').strip()}; step left incomplete")
            if self.peer_exited(rank):
                raise RuntimeError(f"GradientDumper: rank {rank} (pid {self.peers[rank][1]}) exited without writing {directory / name}; "
                                   "step left incomplete")
