"""Message exchanges with SuperNodes over a Flower ``Grid``: one push per message, replies pulled until all
arrived, enough of them did, or the timeout passed."""

from __future__ import annotations

import time

from flwr.app import Message
from flwr.serverapp import Grid


def exchange(
    grid: Grid, nodes: list[int], content, message_type: str, group: str, timeout: float, poll: float,
    enough=None,
) -> tuple[dict[int, Message], dict[int, str]]:
    """Send ``content`` to each of ``nodes`` (``exchange_messages``)."""
    messages = [Message(content, dst_node_id=int(node), message_type=message_type, group_id=group) for node in nodes]
    return exchange_messages(grid, messages, timeout, poll, enough)


def exchange_messages(grid: Grid, messages: list[Message], timeout: float, poll: float, enough=None,
                      ) -> tuple[dict[int, Message], dict[int, str]]:
    """Push each message on its own (no request grows with the number of nodes), pull replies every ``poll``
    seconds until all arrived, ``enough(replies)`` says the replies so far suffice, or ``timeout`` passed.

    Returns (node -> reply, node -> why no usable reply). Error replies (the ClientApp raised, the node
    left the federation) are failures, with Flower's reason."""
    pending: dict[str, int] = {}
    failed: dict[int, str] = {}
    for msg in messages:
        node = int(msg.metadata.dst_node_id)
        ids = list(grid.push_messages([msg]))
        if not ids or ids[0] is None:
            failed[node] = "the SuperLink did not accept the message"
            continue
        pending[str(ids[0])] = node
    got: dict[int, Message] = {}
    deadline = time.monotonic() + timeout
    while pending:
        for reply in grid.pull_messages(list(pending)):
            node = pending.pop(reply.metadata.reply_to_message_id, None)
            if node is None:
                continue
            if reply.has_error():
                failed[node] = f"error {reply.error.code}: {reply.error.reason}"
            else:
                got[node] = reply
        if not pending or time.monotonic() >= deadline or (enough is not None and enough(got)):
            break
        time.sleep(poll)
    if time.monotonic() >= deadline:  # (after an early stop the rest were not needed: not failures)
        for node in pending.values():
            failed[node] = f"no reply within {timeout:g} s"
    return got, failed
