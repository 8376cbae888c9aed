import asyncio, json, sys
from openai import AsyncOpenAI
port = sys.argv[1]
MODEL = "smollm2-135m-instruct"
client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
async def one(i, n):
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Tell me a story number {i}"}],
        max_tokens=n, stream=True, extra_body={"ignore_eos": True}, temperature=0)
    count = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content: count += 1
    return count
async def main():
    import openai
    for _ in range(300):
        try:
            await one(0, 4); break
        except openai.InternalServerError:
            await asyncio.sleep(1)
    counts = await asyncio.gather(*(one(i, 64) for i in range(32)))
    json.dump(sum(counts) + 4, open("/tmp/drive_tokens.json", "w"))
asyncio.run(main())
