// POST /v1/completions: greedy and seeded answers, stop strings, token-id
// prompts, and streaming (with usage) giving the same text as one answer.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { client, MODEL, STORY, QUESTION } from './common.mjs';

const c = client();
const ask = (extra = {}) =>
  c.completions.create({ model: MODEL, prompt: STORY + QUESTION, max_tokens: 12, temperature: 0, ...extra });

test('a greedy completion: text, length, usage; asked again, the same', async () => {
  const a = await ask({ ignore_eos: true });
  assert.equal(a.object, 'text_completion');
  assert.match(a.id, /^cmpl-/);
  assert.equal(a.model, MODEL);
  assert.equal(a.choices.length, 1);
  assert.equal(a.choices[0].index, 0);
  assert.equal(a.choices[0].finish_reason, 'length');
  assert.ok(a.choices[0].text.length > 0);
  assert.equal(a.usage.completion_tokens, 12);
  assert.ok(a.usage.prompt_tokens > 40, JSON.stringify(a.usage));
  assert.equal(a.usage.total_tokens, a.usage.prompt_tokens + a.usage.completion_tokens);
  assert.equal(typeof a.usage.prompt_tokens_details.cached_tokens, 'number');
  const b = await ask({ ignore_eos: true });
  assert.equal(b.choices[0].text, a.choices[0].text);
});

test('a seeded sampled completion repeats; the stop string ends it', async () => {
  const one = await ask({ temperature: 1, seed: 7, max_tokens: 16 });
  const two = await ask({ temperature: 1, seed: 7, max_tokens: 16 });
  assert.equal(one.choices[0].text, two.choices[0].text);
  const greedy = await ask({ max_tokens: 24, ignore_eos: true });
  const word = greedy.choices[0].text.trim().split(/\s+/)[1];
  assert.ok(word, greedy.choices[0].text);
  const stopped = await ask({ max_tokens: 24, ignore_eos: true, stop: word });
  assert.equal(stopped.choices[0].finish_reason, 'stop');
  assert.ok(!stopped.choices[0].text.includes(word), stopped.choices[0].text);
  assert.ok(greedy.choices[0].text.startsWith(stopped.choices[0].text));
});

test('a prompt of token ids is answered', async () => {
  const a = await c.completions.create({ model: MODEL, prompt: [0, 300, 301, 302, 303], max_tokens: 4, temperature: 0 });
  assert.equal(a.usage.prompt_tokens, 5);
  assert.equal(a.usage.completion_tokens <= 4, true);
});

test('a stream: chunks that add up to the answer, then the usage', async () => {
  const whole = await ask({ max_tokens: 20, ignore_eos: true });
  const stream = await ask({ max_tokens: 20, ignore_eos: true, stream: true, stream_options: { include_usage: true } });
  let text = '';
  let finish = null;
  let usage = null;
  let chunks = 0;
  for await (const chunk of stream) {
    assert.equal(chunk.object, 'text_completion');
    assert.equal(chunk.model, MODEL);
    if (chunk.usage) {
      usage = chunk.usage;
      assert.equal(chunk.choices.length, 0);
      continue;
    }
    assert.equal(chunk.usage, null);
    chunks += 1;
    text += chunk.choices[0].text;
    if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
  }
  assert.ok(chunks >= 2, `${chunks} chunks`);
  assert.equal(text, whole.choices[0].text);
  assert.equal(finish, 'length');
  assert.deepEqual(usage, whole.usage);
});

test('return_token_ids: the answer\'s ids, and a stream chunk for each arrival of tokens', async () => {
  const body = { model: MODEL, prompt: STORY + QUESTION, max_tokens: 12, temperature: 0, ignore_eos: true,
    return_token_ids: true };
  const whole = await c.completions.create(body);
  assert.equal(whole.choices[0].token_ids.length, 12);
  const stream = await c.completions.create({ ...body, stream: true, stream_options: { include_usage: true } });
  const ids = [];
  let text = '';
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    if (!chunk.choices.length) continue;
    ids.push(...(chunk.choices[0].token_ids || []));
    text += chunk.choices[0].text;
  }
  assert.deepEqual(ids, whole.choices[0].token_ids);  // greedy: the same tokens
  assert.equal(text, whole.choices[0].text);
  assert.equal(usage.completion_tokens, 12);
  // Without the field, no ids.
  const plain = await c.completions.create({ ...body, return_token_ids: undefined });
  assert.equal(plain.choices[0].token_ids, undefined);
});
