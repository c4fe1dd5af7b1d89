// What the tests of the OpenAI-compatible API share: a client of the
// service tests/openai/with_service.py started (its environment names it).
import OpenAI from 'openai';

export const MODEL = 'penumbra-eval';
export const STORY =
  'Once upon a time there was a little girl named Lily. She liked to play in the park with her dog Max. ' +
  'One day Max found a red ball under a big tree. Lily and Max played with the ball until the sun went down. ';
export const QUESTION = '\n\nQuestion: What did Max find in the park?\nAnswer:';

// A client of tenant alpha (or of `apiKey`), with no retries unless asked:
// a test sees each answer as the server gave it.
export function client({ apiKey = process.env.OPENAI_API_KEY, maxRetries = 0, ...rest } = {}) {
  return new OpenAI({ apiKey, baseURL: process.env.OPENAI_BASE_URL, maxRetries, timeout: 60_000, ...rest });
}

// A raw request to the API (for what the client would not send).
export async function raw(path, { method = 'POST', body, headers = {}, key = process.env.OPENAI_API_KEY } = {}) {
  const res = await fetch(process.env.OPENAI_BASE_URL + path, {
    method,
    headers: { 'content-type': 'application/json', authorization: `Bearer ${key}`, ...headers },
    body,
  });
  const text = await res.text();
  let json = null;
  try {
    json = JSON.parse(text);
  } catch {}
  return { status: res.status, headers: res.headers, text, json };
}
