"""Agent programs for ``rollout.agent`` tests: randomwalks walked through the OpenAI-compatible endpoint with
the real ``openai`` client, in one call or in two (the second extends the first token for token, so the two
merge into one trajectory; or, for half the rows, starts again from the walk's last node, so an episode gives
two rows), and agents that fail."""

from __future__ import annotations

from functools import cache

from openai import AsyncOpenAI

from services.tasks.randomwalks import RandomWalksTask, optimality


@cache
def graph():
    return RandomWalksTask(seed=1000).graph


async def walk(base_url: str, row: dict) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key="tether")
    out = await client.completions.create(model="tether", prompt=row["start"], max_tokens=9)
    return optimality(graph(), row["start"] + out.choices[0].text)


async def walk_in_two_calls(base_url: str, row: dict) -> float:
    """Two steps, then the rest of the walk: the second prompt is the first's text plus its completion."""
    client = AsyncOpenAI(base_url=base_url, api_key="tether")
    first = await client.completions.create(model="tether", prompt=row["start"], max_tokens=2)
    walked = row["start"] + first.choices[0].text
    if first.choices[0].finish_reason == "length":
        second = await client.completions.create(model="tether", prompt=walked, max_tokens=7)
        walked += second.choices[0].text
    return optimality(graph(), walked)


async def walk_in_two_calls_or_two_rows(base_url: str, row: dict) -> float:
    """``walk_in_two_calls`` for rows starting at an even letter; from an odd one, the second call's prompt is
    the walk's last node alone, which does not extend the first call: the episode gives two rows, one
    reward."""
    if ord(row["start"]) % 2 == 0:
        return await walk_in_two_calls(base_url, row)
    client = AsyncOpenAI(base_url=base_url, api_key="tether")
    first = await client.completions.create(model="tether", prompt=row["start"], max_tokens=2)
    walked = row["start"] + first.choices[0].text
    if first.choices[0].finish_reason == "length":
        second = await client.completions.create(model="tether", prompt=walked[-1], max_tokens=7)
        walked += second.choices[0].text
    return optimality(graph(), walked)


async def never_answers(base_url: str, row: dict) -> float:
    raise RuntimeError(f"no answer for {row['start']}")
