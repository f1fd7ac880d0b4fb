"""jmapc 0.4.0 (PyPI, pinned in requirements.txt), as a Python JMAP client would use it, against
tessera's TLS listener in front of Cyrus: session (jmapc always asks https://HOST/.well-known/jmap),
Mailbox/get, Email/query + Email/get, Email/set (a draft), and a blob of BLOB_MIB MiB uploaded and
downloaded. No URL is fixed up on the client side. Prints one JSON object of what it saw; exits
non-zero on an error.

Env: JMAP_HOST (host:port of tessera's TLS listener), TOKEN (a bearer token), BLOB_MIB (30),
REQUESTS_CA_BUNDLE (the test CA).
"""

import hashlib
import json
import os
import tempfile
from pathlib import Path

from jmapc import Client, Email, EmailAddress, EmailBodyPart, EmailBodyValue, Ref
from jmapc.methods import EmailGet, EmailQuery, EmailSet, MailboxGet

client = Client.create_with_api_token(
    host=os.environ["JMAP_HOST"], api_token=os.environ["TOKEN"]
)
out = {}
out["apiUrl"] = client.jmap_session.api_url
account = client.account_id
out["accountId"] = account

mailboxes = client.request(MailboxGet(ids=None), raise_errors=True).data
out["mailboxes"] = sorted(m.name for m in mailboxes)
# The draft goes to Drafts, or to the Inbox where the account has no Drafts mailbox.
drafts = next((m for m in mailboxes if m.role == "drafts"), None) or next(
    m for m in mailboxes if m.role == "inbox"
)

# Both calls in one request, the second reading the first's result (RFC 8620 3.7).
query, got = client.request(
    [EmailQuery(), EmailGet(ids=Ref("/ids"), properties=["subject"])],
    raise_errors=True,
)
out["subjects"] = [e.subject for e in got.response.data]

draft = Email(
    mailbox_ids={drafts.id: True},
    keywords={"$draft": True},
    mail_from=[EmailAddress(email=f"{account}@localhost")],
    subject="tessera draft",
    body_values={"b": EmailBodyValue(value="written through tessera")},
    text_body=[EmailBodyPart(part_id="b", type="text/plain")],
)
created = client.request(EmailSet(create={"d": draft}), raise_errors=True).created
out["draftCreated"] = bool(created and created.get("d") and created["d"].id)

blob = os.urandom(int(os.environ.get("BLOB_MIB", "30")) << 20)
with tempfile.TemporaryDirectory() as d:
    up = Path(d, "blob.bin")
    up.write_bytes(blob)
    uploaded = client.upload_blob(up)
    down = Path(d, "back.bin")
    part = EmailBodyPart(
        blob_id=uploaded.id, name="blob.bin", type="application/octet-stream"
    )
    client.download_attachment(part, down)
    back = down.read_bytes()
out["blobBytes"] = [len(blob), len(back)]
out["blobSame"] = hashlib.sha256(blob).digest() == hashlib.sha256(back).digest()
print(json.dumps(out))
