"""A live Bokeh figure in a notebook: jupyter_bokeh's widget, sending each update as one message.

jupyter_bokeh's `BokehModel` sends one PATCH-DOC message per change of the document, and
Bokeh builds each one by first making a reference of every model the browser has (~450 in a
dashboard: about a millisecond, and enough short-lived objects that the driver's garbage
collector ran in the views' updates nearly every iteration, a full collection of a training
process now and then: a few hundred milliseconds). `BokehWidget` sends the changes made
inside `one_patch()` as one message (the browser applies its events in order, as it does a
Bokeh server's), and refers to the browser's models only as it meets them.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

from bokeh.core.serialization import Serializer
from bokeh.model import Model
from bokeh.protocol.messages.patch_doc import PatchJson, patch_doc
from jupyter_bokeh import BokehModel


class BokehWidget(BokehModel):
    """A Bokeh layout as an ipywidget, kept in sync with the browser."""

    _held: list | None = None  # changes made inside one_patch(), not sent yet
    _holder: int | None = None  # the thread in one_patch(): another thread's changes go at once

    @contextlib.contextmanager
    def one_patch(self) -> Iterator[None]:
        """Send the document changes this thread makes inside the block as one message, when
        it ends."""
        if self._held is not None:  # nested, or another thread's block: changes go as they would
            yield
            return
        self._held, self._holder = [], threading.get_ident()
        try:
            yield
        finally:
            events, self._held, self._holder = self._held, None, None
            if events:
                self._send_patch(events)

    def _document_patched(self, event) -> None:
        if event.setter is self:  # the browser's own change, coming back
            return
        if self._held is not None and self._holder == threading.get_ident():
            self._held.append(event)
        else:
            self._send_patch([event])

    def _send_patch(self, events: list) -> None:
        """Bokeh's PATCH-DOC message of `events` (patch_doc.create, with references made as
        met), sent as BokehModel sends one."""
        doc = events[0].document
        serializer = _Refs(doc.models.synced_references)
        msg = patch_doc(patch_doc.create_header(), {}, PatchJson(events=serializer.encode(events)))
        doc.models.flush_synced(lambda model: not serializer.has_ref(model))  # new models are the browser's now
        msg.add_buffers(*serializer.buffers)
        for part in (msg.header_json, msg.metadata_json, msg.content_json):
            self.send({"msg": "patch", "payload": part})
        for buffer in msg.buffers:
            self.send({"msg": "patch", "payload": json.dumps(buffer.ref)})
            self.send({"msg": "patch"}, [buffer.to_bytes()])


class _Refs(Serializer):
    """Encodes a model the browser has (`synced`) as a reference when it meets one, instead
    of making every reference up front; others in full, as Bokeh's Serializer does."""

    def __init__(self, synced: set[Model]):
        super().__init__()
        self._synced = synced

    def get_ref(self, obj: Any):
        ref = super().get_ref(obj)
        if ref is None and isinstance(obj, Model) and obj in self._synced:
            ref = obj.ref
            self.add_ref(obj, ref)
        return ref

    def has_ref(self, obj: Any) -> bool:
        return self.get_ref(obj) is not None
