// GET /v1/models and the model a request names.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { client, MODEL } from './common.mjs';

test('the served model is listed and retrieved', async () => {
  const c = client();
  const page = await c.models.list();
  const ids = page.data.map((m) => m.id);
  assert.deepEqual(ids, [MODEL]);
  assert.equal(page.data[0].object, 'model');
  assert.equal(page.data[0].owned_by, 'penumbra');
  const m = await c.models.retrieve(MODEL);
  assert.equal(m.id, MODEL);
});

test('another model is 404 model not found', async () => {
  const c = client();
  await assert.rejects(c.models.retrieve('gpt-4o'), (e) => e instanceof OpenAI.NotFoundError && e.status === 404);
  await assert.rejects(
    c.completions.create({ model: 'gpt-4o', prompt: 'hello', max_tokens: 2 }),
    (e) => e instanceof OpenAI.NotFoundError && /serves 'penumbra-eval'/.test(e.message),
  );
});

test('a wrong key is 401 and no key is 401', async () => {
  const bad = client({ apiKey: 'not-a-key-of-anyone-0123456789' });
  await assert.rejects(bad.models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
  await assert.rejects(
    bad.completions.create({ model: MODEL, prompt: 'hello', max_tokens: 2 }),
    (e) => e instanceof OpenAI.AuthenticationError,
  );
});
