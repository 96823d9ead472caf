"""actors/agent_command.py: an agent program as a process of its own, run for real (a Python of the system,
outside the project's virtualenv, where one is there). The job through it is tests/test_recipes.py's
verifiers recipe."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import textwrap

import pytest

from actors.agent_command import CommandFailed, command_agent

# Another interpreter than the tests' where the machine has one: what the bridge is for.
OTHER_PYTHON = shutil.which("python3.11") or sys.executable


def script(tmp_path, body: str):
    path = tmp_path / "agent.py"
    path.write_text(textwrap.dedent(body))
    return command_agent(OTHER_PYTHON, path)


def test_the_command_reads_the_episode_and_its_last_line_is_the_reward(tmp_path):
    agent = script(tmp_path, """
        import json, sys
        episode = json.load(sys.stdin)
        print("a log line first")
        print(len(episode["row"]["question"]) / 10)
    """)
    assert asyncio.run(agent("http://127.0.0.1:1/e/v1", {"question": "abcd"})) == pytest.approx(0.4)


def test_what_the_command_was_given(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/the/engines/packages")
    agent = script(tmp_path, """
        import json, os, sys
        episode = json.load(sys.stdin)
        seen = [episode, os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY"), \
os.environ.get("PYTHONPATH")]
        sys.exit(json.dumps(seen))  # exits 1, the message on stderr
    """)
    with pytest.raises(CommandFailed, match="exited with 1") as failed:
        asyncio.run(agent("http://127.0.0.1:1/e/v1", {"question": "abcd"}))
    seen = json.loads(str(failed.value).split(": ", 1)[1])
    assert seen == [{"base_url": "http://127.0.0.1:1/e/v1", "row": {"question": "abcd"}},
                    "http://127.0.0.1:1/e/v1", "tether", None]


@pytest.mark.parametrize("last_line, message", [("", "last line on stdout is '', not a reward"),
                                                ("done", "last line on stdout is 'done', not a reward")])
def test_a_command_that_prints_no_reward_fails_the_episode(tmp_path, last_line, message):
    agent = script(tmp_path,
                   f"import sys; sys.stdin.read(); print({last_line!r}); print('why', file=sys.stderr)")
    with pytest.raises(CommandFailed, match=message) as failed:
        asyncio.run(agent("http://x/v1", {}))
    assert "stderr: why" in str(failed.value)


def test_the_deadline_kills_the_process(tmp_path):
    pid_file = tmp_path / "pid"
    agent = script(tmp_path, f"""
        import os, time
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(60)
    """)

    async def with_deadline():
        async with asyncio.timeout(2):
            await agent("http://x/v1", {})

    with pytest.raises(TimeoutError):
        asyncio.run(with_deadline())
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left running
        os.kill(int(pid_file.read_text()), 0)


def test_a_program_that_is_not_there_is_refused_when_the_agent_is_made(tmp_path):
    with pytest.raises(FileNotFoundError, match="'no-such-program' is not on PATH"):
        command_agent("no-such-program", "--flag")
    with pytest.raises(FileNotFoundError, match=r"'\./missing/python' is not an executable file under"):
        command_agent("./missing/python", cwd=tmp_path)
    with pytest.raises(ValueError, match="needs a command"):
        command_agent()
