// The Batch API with the official client: a JSONL file uploaded
// (/v1/files, purpose batch), a batch made of it, run to the end, its
// output file read back (each custom_id once, each answer the one a direct
// request gives), listed, cancelled; bad input refused naming the line;
// another tenant sees none of it.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI, { toFile } from 'openai';
import { client, MODEL, STORY, QUESTION } from './common.mjs';
import { jsonl, completionLine, upload, waitFinal, parseLines } from './batch_util.mjs';

const c = client();

test('a batch of completions runs to the end and its output file holds each custom_id once', async () => {
  const prompts = [STORY + QUESTION, 'Once upon a time', 'Lily had a dog named', 'The sun went down and'];
  const lines = prompts.map((p, i) => completionLine(`req-${i}`, p));
  const file = await upload(c, jsonl(lines));
  assert.equal(file.object, 'file');
  assert.equal(file.purpose, 'batch');
  assert.equal(file.bytes, Buffer.byteLength(jsonl(lines)));
  assert.equal(await (await c.files.content(file.id)).text(), jsonl(lines));

  const created = await c.batches.create({
    input_file_id: file.id, endpoint: '/v1/completions', completion_window: '24h', metadata: { run: 'test' },
  });
  assert.equal(created.object, 'batch');
  assert.match(created.id, /^batch_/);
  assert.equal(created.input_file_id, file.id);
  assert.deepEqual(created.metadata, { run: 'test' });
  assert.equal(created.request_counts.total, prompts.length);

  const done = await waitFinal(c, created.id);
  assert.equal(done.status, 'completed', JSON.stringify(done));
  assert.deepEqual(done.request_counts, { total: prompts.length, completed: prompts.length, failed: 0 });
  assert.equal(done.error_file_id, null);
  assert.ok(done.completed_at >= done.created_at);

  const out = parseLines(await (await c.files.content(done.output_file_id)).text());
  assert.deepEqual(out.map((l) => l.custom_id).sort(), lines.map((l) => l.custom_id).sort());
  const meta = await c.files.retrieve(done.output_file_id);
  assert.ok(meta.bytes > 0);
  for (const l of out) {
    assert.equal(l.error, null);
    assert.equal(l.response.status_code, 200);
    assert.equal(l.response.body.object, 'text_completion');
    assert.equal(l.response.body.usage.completion_tokens, 6);
  }
  // Each answer is the one a direct (greedy) request gives.
  const direct = await c.completions.create({ ...lines[2].body });
  assert.equal(out.find((l) => l.custom_id === 'req-2').response.body.choices[0].text, direct.choices[0].text);

  const list = await c.batches.list({ limit: 100 });
  assert.ok(list.data.some((b) => b.id === created.id));
  const files = await c.files.list({ purpose: 'batch' });
  assert.ok(files.data.some((f) => f.id === file.id));

  // Another tenant sees none of it.
  const beta = client({ apiKey: process.env.PENUMBRA_KEY_BETA });
  await assert.rejects(beta.batches.retrieve(created.id), (e) => e instanceof OpenAI.NotFoundError);
  await assert.rejects(beta.files.content(file.id), (e) => e instanceof OpenAI.NotFoundError);
  await assert.rejects(beta.files.content(done.output_file_id), (e) => e instanceof OpenAI.NotFoundError);
  assert.ok(!(await beta.batches.list()).data.some((b) => b.id === created.id));

  // Deleting the output file deletes the batch; the input file is deleted on its own.
  assert.deepEqual(await c.files.delete(done.output_file_id),
    { id: done.output_file_id, object: 'file', deleted: true });
  await assert.rejects(c.batches.retrieve(created.id), (e) => e instanceof OpenAI.NotFoundError);
  await c.files.delete(file.id);
  await assert.rejects(c.files.retrieve(file.id), (e) => e instanceof OpenAI.NotFoundError);
});

test('a batch of chat completions over a document put once', async () => {
  const doc = await c.post('/documents', { body: { name: 'story', text: STORY.repeat(3) } });
  const lines = ['What did Max find?', 'Who is Lily?'].map((q, i) => ({
    custom_id: `chat-${i}`, method: 'POST', url: '/v1/chat/completions',
    body: { model: MODEL, documents: [doc.id], max_tokens: 4, temperature: 0, ignore_eos: true,
            messages: [{ role: 'user', content: q }] },
  }));
  const file = await upload(c, jsonl(lines));
  const b = await c.batches.create({ input_file_id: file.id, endpoint: '/v1/chat/completions', completion_window: '24h' });
  const done = await waitFinal(c, b.id);
  assert.equal(done.status, 'completed', JSON.stringify(done));
  const out = parseLines(await (await c.files.content(done.output_file_id)).text());
  assert.equal(out.length, 2);
  for (const l of out) {
    assert.equal(l.response.body.object, 'chat.completion');
    assert.equal(l.response.body.usage.prompt_tokens_details.cached_tokens, doc.tokens);
  }
});

test('a batch whose request names a document that does not exist is refused, naming it', async () => {
  const lines = [completionLine('ok', 'Once upon a time'),
    completionLine('missing-doc', 'Once', { documents: ['doc-does-not-exist'] })];
  const file = await upload(c, jsonl(lines));
  // Each line is checked as its request would be when the batch is made.
  await assert.rejects(
    c.batches.create({ input_file_id: file.id, endpoint: '/v1/completions', completion_window: '24h' }),
    (e) => e instanceof OpenAI.NotFoundError && /missing-doc/.test(e.message) && /doc-does-not-exist/.test(e.message),
  );
});

test('bad input files and batches are refused by name', async () => {
  const bad = await upload(c, jsonl([completionLine('a', 'x'), { ...completionLine('b', 'y'), url: '/v1/chat/completions' }]));
  await assert.rejects(
    c.batches.create({ input_file_id: bad.id, endpoint: '/v1/completions', completion_window: '24h' }),
    (e) => e instanceof OpenAI.UnprocessableEntityError && /line 2 \(custom_id 'b'\)/.test(e.message),
  );
  const dup = await upload(c, jsonl([completionLine('a', 'x'), completionLine('a', 'y')]));
  await assert.rejects(
    c.batches.create({ input_file_id: dup.id, endpoint: '/v1/completions', completion_window: '24h' }),
    (e) => e instanceof OpenAI.UnprocessableEntityError && /line 2.*not unique/.test(e.message),
  );
  const notJson = await upload(c, '{"custom_id": "a", \n');
  await assert.rejects(
    c.batches.create({ input_file_id: notJson.id, endpoint: '/v1/completions', completion_window: '24h' }),
    (e) => e instanceof OpenAI.UnprocessableEntityError && /line 1/.test(e.message),
  );
  const stream = await upload(c, jsonl([completionLine('s', 'x', { stream: true })]));
  await assert.rejects(
    c.batches.create({ input_file_id: stream.id, endpoint: '/v1/completions', completion_window: '24h' }),
    (e) => e instanceof OpenAI.UnprocessableEntityError && /stream/.test(e.message),
  );
  const good = await upload(c, jsonl([completionLine('a', 'x')]));
  await assert.rejects(
    c.batches.create({ input_file_id: good.id, endpoint: '/v1/embeddings', completion_window: '24h' }),
    (e) => e instanceof OpenAI.UnprocessableEntityError && /embeddings/.test(e.message),
  );
  await assert.rejects(
    c.batches.create({ input_file_id: good.id, endpoint: '/v1/completions', completion_window: '1000h' }),
    (e) => e instanceof OpenAI.UnprocessableEntityError && /completion_window/.test(e.message),
  );
  await assert.rejects(
    c.batches.create({ input_file_id: 'file-0000000000000000', endpoint: '/v1/completions', completion_window: '24h' }),
    (e) => e instanceof OpenAI.NotFoundError,
  );
  await assert.rejects(
    c.files.create({ file: await toFile(Buffer.from('x'), 'a.txt'), purpose: 'fine-tune' }),
    (e) => e instanceof OpenAI.UnprocessableEntityError && /purpose/.test(e.message),
  );
  await assert.rejects(c.batches.retrieve('batch_nothing'), (e) => e instanceof OpenAI.NotFoundError);
  await assert.rejects(c.files.content('file-batch_0000000000000000-output'), (e) => e instanceof OpenAI.NotFoundError);
  const badKey = client({ apiKey: 'not-a-key-of-anyone-at-all-0000' });
  await assert.rejects(badKey.files.list(), (e) => e instanceof OpenAI.AuthenticationError);
});

test('a batch cancelled: cancelled requests are in its error file', async () => {
  const lines = Array.from({ length: 24 }, (_, i) => completionLine(`c-${i}`, `Story number ${i}:`, { max_tokens: 32 }));
  const file = await upload(c, jsonl(lines));
  const b = await c.batches.create({ input_file_id: file.id, endpoint: '/v1/completions', completion_window: '24h' });
  const cancelling = await c.batches.cancel(b.id);
  assert.ok(['cancelling', 'cancelled'].includes(cancelling.status), cancelling.status);
  const done = await waitFinal(c, b.id);
  assert.equal(done.status, 'cancelled');
  const counts = done.request_counts;
  assert.equal(counts.completed + counts.failed, 24, JSON.stringify(counts));
  assert.ok(counts.failed > 0);
  const errors = parseLines(await (await c.files.content(done.error_file_id)).text());
  assert.equal(errors.length, counts.failed);
  assert.ok(errors.every((l) => l.response === null && l.error.code === 'batch_cancelled'), JSON.stringify(errors[0]));
  await assert.rejects(c.batches.cancel(b.id), (e) => e instanceof OpenAI.ConflictError);
});
