// Errors in OpenAI's shape with the right status: malformed and oversized
// bodies, unsupported fields, quotas (429 with Retry-After); the service
// keeps serving after each, and a stream the client drops is cancelled.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { client, raw, MODEL, STORY, QUESTION } from './common.mjs';

const c = client();
const errorShape = (r) => {
  assert.equal(typeof r.json?.error?.message, 'string', r.text);
  assert.ok('type' in r.json.error && 'param' in r.json.error && 'code' in r.json.error, r.text);
};

test('malformed, deep, oversized and unrouted requests get typed errors', async () => {
  let r = await raw('/completions', { body: '{"model": "penumbra-eval", "prompt": ' });
  assert.equal(r.status, 400);
  errorShape(r);
  r = await raw('/completions', { body: '['.repeat(100000) });
  assert.equal(r.status, 400);
  assert.match(r.json.error.message, /nested deeper/);
  r = await raw('/completions', { body: JSON.stringify({ model: MODEL, prompt: 'x'.repeat(1_500_000) }) });
  assert.equal(r.status, 413);
  errorShape(r);
  r = await raw('/nothing-here', { method: 'GET' });
  assert.equal(r.status, 404);
  errorShape(r);
  r = await raw('/completions', { body: JSON.stringify({ model: MODEL, prompt: 12 }) });
  assert.equal(r.status, 422);
  assert.match(r.json.error.message, /'prompt'/);
  const ok = await c.completions.create({ model: MODEL, prompt: QUESTION, max_tokens: 2 });
  assert.equal(ok.choices.length, 1);
});

test('what is not served is refused by name', async () => {
  const refused = async (body, pattern) =>
    assert.rejects(
      c.completions.create({ model: MODEL, prompt: QUESTION, max_tokens: 2, ...body }),
      (e) => e instanceof OpenAI.UnprocessableEntityError && pattern.test(e.message),
    );
  await refused({ logprobs: 2 }, /logprobs/);
  await refused({ n: 2 }, /'n' must be 1/);
  await refused({ echo: true }, /echo/);
  await refused({ temperature: 3 }, /temperature/);
  await refused({ max_tokens: 0 }, /max_tokens/);
  await assert.rejects(
    c.chat.completions.create({
      model: MODEL, max_tokens: 2, messages: [{ role: 'user', content: 'hi' }],
      tools: [{ type: 'function', function: { name: 'f', parameters: {} } }],
    }),
    (e) => e instanceof OpenAI.UnprocessableEntityError && /tools/.test(e.message),
  );
});

test('a tenant past its quota gets 429 with Retry-After', async () => {
  const tight = client({ apiKey: process.env.PENUMBRA_KEY_TIGHT });
  // 64 generated tokens a minute: 40 now leaves no room for 40 more.
  await tight.completions.create({ model: MODEL, prompt: QUESTION, max_tokens: 40, temperature: 0, ignore_eos: true });
  const r = await raw('/completions', {
    key: process.env.PENUMBRA_KEY_TIGHT,
    body: JSON.stringify({ model: MODEL, prompt: QUESTION, max_tokens: 40, ignore_eos: true }),
  });
  assert.equal(r.status, 429, r.text);
  assert.equal(r.json.error.type, 'rate_limit_error');
  assert.ok(Number(r.headers.get('retry-after')) >= 1, r.headers.get('retry-after'));
  await assert.rejects(
    tight.completions.create({ model: MODEL, prompt: QUESTION, max_tokens: 40 }),
    (e) => e instanceof OpenAI.RateLimitError && e.status === 429,
  );
  // Other tenants are served meanwhile.
  const ok = await c.completions.create({ model: MODEL, prompt: QUESTION, max_tokens: 2 });
  assert.equal(ok.choices.length, 1);
});

test('a stream the client drops is cancelled on the service', async () => {
  const running = async () => {
    const text = await (await fetch(process.env.PENUMBRA_METRICS)).text();
    return text
      .split('\n')
      .filter((l) => l.startsWith('penumbra_coordinator_requests_running'))
      .reduce((sum, l) => sum + Number(l.split(' ').pop()), 0);
  };
  const controller = new AbortController();
  const stream = await c.completions.create(
    { model: MODEL, prompt: STORY + QUESTION, max_tokens: 4000, ignore_eos: true, temperature: 0, stream: true },
    { signal: controller.signal },
  );
  // The client ends its iteration quietly when aborted.
  let n = 0;
  for await (const chunk of stream) {
    if (chunk.choices[0]?.text) n += 1;
    if (n === 3) {
      controller.abort();
      break;
    }
  }
  assert.equal(n, 3);
  // Cancelled within a few polls, long before 4000 tokens.
  const until = Date.now() + 20_000;
  while ((await running()) !== 0 && Date.now() < until) await new Promise((r) => setTimeout(r, 200));
  assert.equal(await running(), 0);
});
