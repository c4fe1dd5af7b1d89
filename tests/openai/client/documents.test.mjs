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
