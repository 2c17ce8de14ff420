"""One device per rank: the check made before torch's NCCL group of a procgroup group forms (torch-free).

NCCL refuses a communicator in which two ranks drive the same GPU, with a bare "Duplicate GPU detected"
(or it hangs, in some versions).  Before the engine builds its NCCL group, the members exchange
(host, device id) records over procgroup's transport and every member runs :func:`check_one_device_per_rank`
on the same list, so every member raises the same ConfigError naming both ranks, the device and the fix.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

from ...errors import ConfigError

__all__ = ["check_one_device_per_rank", "encode_record", "decode_record", "RECORD_BYTES"]

#: bytes of one member's record in the exchange (device id and its readable name, NUL-padded)
RECORD_BYTES = 160
_SEP = "\x1f"


def encode_record(device_id: str, device_name: str) -> bytes:
    """One member's record: ``device_id`` (a GPU's UUID or PCI bus id) and its name ("cuda:0"), padded."""
    raw = f"{device_id}{_SEP}{device_name}".encode()[:RECORD_BYTES]
    return raw.ljust(RECORD_BYTES, b"\0")


def decode_record(raw: bytes) -> Tuple[str, str]:
    """(device id, device name) of a record made by :func:`encode_record`."""
    text = bytes(raw).rstrip(b"\0").decode(errors="replace")
    dev_id, _, name = text.partition(_SEP)
    return dev_id, name


def check_one_device_per_rank(
    entries: Sequence[Tuple[str, str]],
    ranks: Sequence[int],
    *,
    names: Optional[Sequence[str]] = None,
    hostnames: Optional[Sequence[str]] = None,
    op: str = "the first CUDA operation",
) -> None:
    """Raise ConfigError when two of ``ranks`` share a device: ``entries[i]`` is (host key, device id) of
    ``ranks[i]`` (a global rank); ``names[i]`` its device's name ("cuda:0") and ``hostnames[i]`` its host's
    readable name, for the message.  Every member passes the same lists, so every member raises the same error.
    """
    seen: Dict[Tuple[str, str], int] = {}
    for i, key in enumerate(entries):
        first = seen.setdefault((key[0], key[1]), i)
        if first == i:
            continue
        a, b = ranks[first], ranks[i]
        host = hostnames[i] if hostnames else key[0]
        dev_a = names[first] if names else "?"
        dev_b = names[i] if names else "?"
        dev = dev_a if dev_a == dev_b else f"{dev_a} and {dev_b}"
        raise ConfigError(
            f"{op}: ranks {a} and {b} on host {host} both use the same GPU ({dev}, id {key[1]}); NCCL needs one "
            "GPU per rank (it would fail with 'Duplicate GPU detected'). Give each rank its own device before "
            "its first CUDA operation: torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) and tensors on "
            "device='cuda' (or torch.device('cuda', LOCAL_RANK)), or start each rank with its own "
            "CUDA_VISIBLE_DEVICES; with fewer GPUs than ranks on a host, start fewer ranks there "
            "(--nproc-per-node), or use backend='cpu' with CPU tensors"
        )
