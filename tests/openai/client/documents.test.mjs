// Documents (our extension): put once through /v1/documents, then asked
// about by id: the prompt follows the document's cached state
// (prompt_tokens_details.cached_tokens), in completions and in chat.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { client, MODEL, STORY, QUESTION } from './common.mjs';

const c = client();

test('a document put, listed, asked about from the cache, deleted', async () => {
  const doc = await c.post('/documents', { body: { name: 'story', text: STORY.repeat(4) } });
  assert.equal(doc.object, 'document');
  assert.equal(doc.state, 'ready');
  assert.ok(doc.tokens > 100, JSON.stringify(doc));
  const got = await c.get(`/documents/${doc.id}`);
  assert.equal(got.tokens, doc.tokens);
  const list = await c.get('/documents', { query: { limit: 100 } });
  assert.ok(list.data.some((d) => d.id === doc.id));

  const a = await c.completions.create({
    model: MODEL, prompt: QUESTION, documents: [doc.id], max_tokens: 8, temperature: 0, ignore_eos: true,
  });
  assert.equal(a.usage.prompt_tokens_details.cached_tokens, doc.tokens);
  assert.ok(a.usage.prompt_tokens > doc.tokens);
  const chat = await c.chat.completions.create({
    model: MODEL, documents: [doc.id], max_tokens: 8, temperature: 0, ignore_eos: true,
    messages: [{ role: 'user', content: 'What did Max find in the park?' }],
  });
  assert.equal(chat.usage.prompt_tokens_details.cached_tokens, doc.tokens);
  assert.ok(chat.choices[0].message.content.length > 0);

  // Another tenant does not see it.
  const beta = client({ apiKey: process.env.PENUMBRA_KEY_BETA });
  await assert.rejects(beta.get(`/documents/${doc.id}`), (e) => e instanceof OpenAI.NotFoundError);
  await assert.rejects(
    beta.completions.create({ model: MODEL, prompt: QUESTION, documents: [doc.id], max_tokens: 2 }),
    (e) => e instanceof OpenAI.NotFoundError,
  );

  const del = await c.delete(`/documents/${doc.id}`);
  assert.deepEqual(del, { id: doc.id, object: 'document.deleted', deleted: true });
  await assert.rejects(c.get(`/documents/${doc.id}`), (e) => e instanceof OpenAI.NotFoundError);
});

test('a prompt that starts with a document put is served from its cache without naming it', async () => {
  const text = STORY.repeat(5);
  const doc = await c.post('/documents', { body: { name: 'auto', text } });
  assert.equal(doc.state, 'ready');
  // Completions: the document's text, then the question.
  const auto = await c.completions.create({
    model: MODEL, prompt: text + QUESTION, max_tokens: 8, temperature: 0, ignore_eos: true,
  });
  assert.equal(auto.usage.prompt_tokens_details.cached_tokens, doc.tokens, JSON.stringify(auto.usage));
  const named = await c.completions.create({
    model: MODEL, prompt: QUESTION, documents: [doc.id], max_tokens: 8, temperature: 0, ignore_eos: true,
  });
  assert.equal(auto.usage.prompt_tokens, named.usage.prompt_tokens);
  assert.equal(auto.choices[0].text, named.choices[0].text);
  // Chat: the document as the system message (the template writes it first).
  const chat = await c.chat.completions.create({
    model: MODEL, max_tokens: 8, temperature: 0, ignore_eos: true,
    messages: [{ role: 'system', content: text }, { role: 'user', content: 'What did Max find in the park?' }],
  });
  assert.equal(chat.usage.prompt_tokens_details.cached_tokens, doc.tokens, JSON.stringify(chat.usage));
  // Another tenant's prompt with the same text is not served from it.
  const beta = client({ apiKey: process.env.PENUMBRA_KEY_BETA });
  const other = await beta.completions.create({ model: MODEL, prompt: text + QUESTION, max_tokens: 2 });
  assert.equal(other.usage.prompt_tokens_details.cached_tokens, 0);
  // A prompt that is only the document (nothing after it) is prefilled as it is.
  const whole = await c.completions.create({ model: MODEL, prompt: text, max_tokens: 2 });
  assert.equal(whole.usage.prompt_tokens_details.cached_tokens, 0);
  await c.delete(`/documents/${doc.id}`);
  const after = await c.completions.create({ model: MODEL, prompt: text + QUESTION, max_tokens: 2 });
  assert.equal(after.usage.prompt_tokens_details.cached_tokens, 0);
});
