"""The terminal chat's Ollama-style commands: /set parameter, /show, /save and /load."""

from __future__ import annotations

import json
from pathlib import Path

from flashllm.chat_session import ChatSession


def test_set_parameter_show_save_load(tmp_path: Path) -> None:
    session = ChatSession()
    assert not session.command("/set parameter temperature 0.3").error
    assert not session.command("/set parameter num_predict 12").error
    assert session.command("/set parameter top_k 5").error  # not a chat setting: refused, nothing changes
    assert (session.settings.temperature, session.settings.max_tokens) == (0.3, 12)
    session.command("/set system be brief")
    session.history.add_exchange("hi", "hello")
    shown = session.command("/show").text
    assert "temperature = 0.3" in shown and "be brief" in shown
    path = tmp_path / "chat.json"
    assert not session.command(f"/save {path}").error
    other = ChatSession()
    assert not other.command(f"/load {path}").error
    assert other.history.turns == session.history.turns and other.history.system == "be brief"
    assert other.settings == session.settings
    for bad in ({"turns": [{"role": "system", "content": "x"}]}, {"settings": {"temperature": "hot"}}, [1],
                {"settings": {"evil": 1}}):
        path.write_text(json.dumps(bad))
        assert other.command(f"/load {path}").error, bad
    assert other.history.turns == session.history.turns  # a refused file changes nothing
    assert other.command(f"/load {tmp_path / 'missing.json'}").error
