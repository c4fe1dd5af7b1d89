// A batch survives its coordinator killed with SIGKILL mid-run:
// tests/openai/with_service.py --restart-coordinator starts it again on the
// same ports and data directory; the batch resumes, and its output file
// holds every custom_id exactly once, each answer the one a run without the
// kill gives (greedy).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { client } from './common.mjs';
import { jsonl, completionLine, upload, waitFinal, parseLines } from './batch_util.mjs';

const c = client({ maxRetries: 0 });

// Calls f until it answers (the coordinator is being restarted), at most ms.
async function eventually(f, ms = 90_000) {
  const end = Date.now() + ms;
  for (;;) {
    try {
      return await f();
    } catch (e) {
      if (Date.now() > end) throw e;
      await new Promise((r) => setTimeout(r, 300));
    }
  }
}

test('SIGKILL of the coordinator during a batch: the output file is complete, each custom_id once', async () => {
  const pid = Number(process.env.PENUMBRA_COORDINATOR_PID);
  assert.ok(pid > 0);
  const lines = Array.from({ length: 12 }, (_, i) =>
    completionLine(`k-${String(i).padStart(2, '0')}`, `Once upon a time, story ${i}:`, { max_tokens: 24 }));
  const file = await upload(c, jsonl(lines));
  const b = await c.batches.create({ input_file_id: file.id, endpoint: '/v1/completions', completion_window: '24h' });
  // Kill once some requests have answers and others do not.
  let before;
  for (let i = 0; i < 600; ++i) {
    before = await c.batches.retrieve(b.id);
    if (before.request_counts.completed >= 1 || before.status !== 'in_progress') break;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.equal(before.status, 'in_progress', 'the batch finished before the kill: ' + JSON.stringify(before));
  process.kill(pid, 'SIGKILL');
  console.log(`killed the coordinator with ${before.request_counts.completed} of 12 answered`);

  const done = await eventually(async () => waitFinal(c, b.id, 180_000));
  assert.equal(done.status, 'completed', JSON.stringify(done));
  assert.deepEqual(done.request_counts, { total: 12, completed: 12, failed: 0 });
  const out = parseLines(await (await c.files.content(done.output_file_id)).text());
  const ids = out.map((l) => l.custom_id);
  assert.equal(new Set(ids).size, ids.length, 'a custom_id twice: ' + ids.join(','));
  assert.deepEqual(ids.sort(), lines.map((l) => l.custom_id).sort());
  for (const l of out) assert.equal(l.response.body.usage.completion_tokens, 24);
  // The answers are those of an uninterrupted (greedy) run.
  for (const k of [0, 11]) {
    const direct = await c.completions.create({ ...lines[k].body });
    assert.equal(out.find((l) => l.custom_id === lines[k].custom_id).response.body.choices[0].text,
      direct.choices[0].text);
  }
});
