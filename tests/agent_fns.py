"""User agents named by import path in the agent tests (``tests.agent_fns:NAME``): each is what a
user writes, an ``async def agent(client, item)`` over a real ``openai.AsyncOpenAI`` client."""

import asyncio
import os


async def answer(client, item):
    """One chat turn: the prompt as the user's message; reward 1 when the reply is the answer."""
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": item.prompt}])
    return float(reply.choices[0].message.content.strip() == item.answer)


async def hang(client, item):
    """Never returns (a hung agent)."""
    await asyncio.sleep(3600)
    return 0.0


async def not_a_reward(client, item):
    return "yes"


async def slow_answer(client, item):
    """``answer`` after a random wait of up to 0.3 s (a tool call with variable latency)."""
    import random

    await asyncio.sleep(random.random() * 0.3)
    return await answer(client, item)


async def flaky_slow_answer(client, item):
    """``slow_answer``, raising instead on the first run of each item (a file under FLASH_TEST_MARKS)."""
    marks = os.environ.get("FLASH_TEST_MARKS", "")
    mark = os.path.join(marks, f"{item.index}")
    if marks and not os.path.exists(mark):
        open(mark, "w").close()
        raise RuntimeError("the agent's tool failed")
    return await slow_answer(client, item)


async def stall_once(client, item):
    """First run of an item: mark it (``item.meta['marks']``) and wait an hour; later runs: reward 1."""
    mark = os.path.join(item.meta["marks"], f"{item.index}")
    if not os.path.exists(mark):
        open(mark, "w").close()
        await asyncio.sleep(3600)
    return 1.0


async def block_once(client, item):
    """``stall_once``, but blocking its event loop (a synchronous call that never returns)."""
    import time

    mark = os.path.join(item.meta["marks"], f"{item.index}")
    if not os.path.exists(mark):
        open(mark, "w").close()
        time.sleep(3600)
    return 1.0
