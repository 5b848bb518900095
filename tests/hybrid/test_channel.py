"""A weight channel between members on one machine (two threads, a real gloo group over a
FileStore): what it carries, and that its rendezvous file does not outlive it."""

import gc
import os
import stat
import tempfile
import threading

import torch

from workbench.hybrid.channel import WeightChannel, open_address


def run_members(address, close: bool) -> list:
    """Rank 0 sends two tensors, rank 1 receives them; each member in a thread of its own."""
    got, errors = [], []
    sent = [("w", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(4, dtype=torch.float64))]

    def member(rank: int) -> None:
        try:
            channel = WeightChannel(address, rank, "cpu")
            if rank == 0:
                channel.send(iter(sent))
            else:
                got.extend((name, tensor.clone()) for name, tensor in channel.receive())
            if close:
                channel.close()
            del channel
        except Exception as err:  # surfaced by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert [name for name, _ in got] == ["w", "b"]
    for (_, tensor), (_, expected) in zip(got, sent):
        assert torch.equal(tensor, expected)
    return got


def test_a_local_channel_rendezvous_is_a_private_file_gone_after_its_members():
    for close in (True, False):  # closed by its members, or merely dropped by them
        address = open_address(2, local=True)
        assert address.kind == "file"
        assert stat.S_IMODE(os.stat(address.where).st_mode) == 0o600  # the owner's alone
        run_members(address, close)
        gc.collect()
        assert not os.path.exists(address.where), f"close={close}: {address.where} left behind"
        folder = os.path.dirname(address.where)  # no folder of its own left either
        assert folder == tempfile.gettempdir() or not os.path.exists(folder), f"close={close}: {folder} left behind"
