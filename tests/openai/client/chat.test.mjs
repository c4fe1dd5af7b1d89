// POST /v1/chat/completions through the model's chat template: answers,
// streams (the role first, usage last), roles and content parts.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { client, MODEL, STORY } from './common.mjs';

const c = client();
const messages = [
  { role: 'system', content: STORY },
  { role: 'user', content: 'What did Max find in the park?' },
];

test('a chat answer is the completion of the template-rendered prompt', async () => {
  const chat = await c.chat.completions.create({ model: MODEL, messages, max_tokens: 10, temperature: 0, ignore_eos: true });
  assert.equal(chat.object, 'chat.completion');
  assert.match(chat.id, /^chatcmpl-/);
  assert.equal(chat.choices[0].message.role, 'assistant');
  assert.equal(chat.choices[0].finish_reason, 'length');
  assert.equal(chat.usage.completion_tokens, 10);
  // configs/chat_templates/question-answer.jinja: what the template writes
  // (its <|bos|>; the completion's comes from the tokenizer).
  const prompt = STORY + '\n\nQuestion: What did Max find in the park?\nAnswer:';
  const done = await c.completions.create({ model: MODEL, prompt, max_tokens: 10, temperature: 0, ignore_eos: true });
  assert.equal(chat.choices[0].message.content, done.choices[0].text);
});

test('a chat stream: the role, then content adding up to the answer, then usage', async () => {
  const whole = await c.chat.completions.create({ model: MODEL, messages, max_completion_tokens: 16, temperature: 0, ignore_eos: true });
  const stream = await c.chat.completions.create({
    model: MODEL, messages, max_completion_tokens: 16, temperature: 0, ignore_eos: true,
    stream: true, stream_options: { include_usage: true },
  });
  let content = '';
  let first = true;
  let usage = null;
  let finish = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    if (chunk.usage) {
      usage = chunk.usage;
      continue;
    }
    if (first) assert.equal(chunk.choices[0].delta.role, 'assistant');
    first = false;
    content += chunk.choices[0].delta.content ?? '';
    finish = chunk.choices[0].finish_reason ?? finish;
  }
  assert.equal(content, whole.choices[0].message.content);
  assert.equal(finish, 'length');
  assert.deepEqual(usage, whole.usage);
});

test('developer messages and text parts are taken; an image part is refused', async () => {
  const parts = await c.chat.completions.create({
    model: MODEL, max_tokens: 6, temperature: 0, ignore_eos: true,
    messages: [
      { role: 'developer', content: STORY },
      { role: 'user', content: [{ type: 'text', text: 'What did Max find in the park?' }] },
    ],
  });
  const plain = await c.chat.completions.create({ model: MODEL, messages, max_tokens: 6, temperature: 0, ignore_eos: true });
  assert.equal(parts.choices[0].message.content, plain.choices[0].message.content);
  await assert.rejects(
    c.chat.completions.create({
      model: MODEL, max_tokens: 4,
      messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'http://127.0.0.1/x.png' } }] }],
    }),
    (e) => e instanceof OpenAI.UnprocessableEntityError && /image_url/.test(e.message),
  );
});

test('a conversation: earlier answers are in the prompt', async () => {
  const turns = [...messages, { role: 'assistant', content: 'A red ball.' }, { role: 'user', content: 'Where was it?' }];
  const a = await c.chat.completions.create({ model: MODEL, messages: turns, max_tokens: 8, temperature: 0, ignore_eos: true });
  const short = await c.chat.completions.create({ model: MODEL, messages, max_tokens: 8, temperature: 0, ignore_eos: true });
  assert.ok(a.usage.prompt_tokens > short.usage.prompt_tokens + 8, `${a.usage.prompt_tokens} vs ${short.usage.prompt_tokens}`);
});

test('requests after streams: new connections resume their TLS session (no retries)', async () => {
  // Node's fetch opens the request after a stream on a new connection with
  // the earlier connection's session ticket; a server refusing resumption
  // failed every such request with "Connection error."
  for (let i = 0; i < 4; i++) {
    const stream = await c.chat.completions.create({
      model: MODEL, messages, max_completion_tokens: 4, temperature: 0, ignore_eos: true,
      stream: true, stream_options: { include_usage: i % 2 === 0 },
    });
    let chunks = 0;
    for await (const _ of stream) chunks++;
    assert.ok(chunks > 1);
    const after = await c.chat.completions.create({ model: MODEL, messages, max_tokens: 2, temperature: 0, ignore_eos: true });
    assert.equal(after.usage.completion_tokens, 2);
  }
});
