// jmap-jam 0.13.1, as a webmail would use it, against tessera's JMAP session resource:
// session, Mailbox/get, Email/query + Email/get, Email/set (a draft), and a blob of BLOB_MIB MiB
// uploaded and downloaded. No URL is fixed up on the client side: the session's URLs are used
// as tessera answers them. Prints one JSON object of what it saw; exits non-zero on an error.
// Env: SESSION_URL (tessera's /.well-known/jmap), TOKEN (a bearer token), BLOB_MIB (30).
import { createHash, randomBytes } from "node:crypto";
import JamClient from "jmap-jam";

const jam = new JamClient({
  sessionUrl: process.env.SESSION_URL,
  bearerToken: process.env.TOKEN,
});
const out = {};
const session = await jam.session;
out.apiUrl = session.apiUrl;
const accountId = await jam.getPrimaryAccount();
out.accountId = accountId;

const [mailboxes] = await jam.api.Mailbox.get({ accountId });
out.mailboxes = mailboxes.list.map((m) => m.name).sort();
// The draft goes to Drafts, or to the Inbox where the account has no Drafts mailbox.
const drafts =
  mailboxes.list.find((m) => m.role === "drafts") ??
  mailboxes.list.find((m) => m.role === "inbox");

// Both calls in one request, the second reading the first's result (RFC 8620 3.7).
const [{ emails }] = await jam.requestMany((t) => {
  const found = t.Email.query({ accountId });
  return {
    found,
    emails: t.Email.get({ accountId, ids: found.$ref("/ids"), properties: ["subject"] }),
  };
});
out.subjects = emails.list.map((e) => e.subject);

const [set] = await jam.api.Email.set({
  accountId,
  create: {
    d: {
      mailboxIds: { [drafts.id]: true },
      keywords: { $draft: true },
      from: [{ email: `${accountId}@localhost` }],
      subject: "tessera draft",
      bodyValues: { b: { value: "written through tessera" } },
      textBody: [{ partId: "b", type: "text/plain" }],
    },
  },
});
out.draftCreated = Boolean(set.created?.d?.id);

const blob = randomBytes(Number(process.env.BLOB_MIB ?? 30) << 20);
const sha = (b) => createHash("sha256").update(b).digest("hex");
const uploaded = await jam.uploadBlob(accountId, blob);
const download = await jam.downloadBlob({
  accountId,
  blobId: uploaded.blobId,
  mimeType: "application/octet-stream",
  fileName: "blob.bin",
});
const back = Buffer.from(await download.arrayBuffer());
out.blobBytes = [blob.length, back.length];
out.blobSame = sha(blob) === sha(back);
console.log(JSON.stringify(out));
