package ratelimit

import (
	"context"
	"io"
)

// byteBucket returns the current byte bucket of tenant in direction d: nil when
// unlimited, ErrUnknownTenant when the tenant is not configured. It is looked
// up on every call so that a reload applies to streams already running.
func (l *Limits) byteBucket(tenant string, d Direction) (*bucket, error) {
	ts := l.st.Load().tenants[tenant]
	if ts == nil || d >= numDirections {
		return nil, ErrUnknownTenant
	}
	return ts.bytes[d], nil
}

// Reader wraps r so that bytes read through it are paid for from tenant's
// bucket for direction dir, which every stream of the tenant in that direction
// shares. Each Read asks for at most one burst and then waits (honouring ctx)
// until the bytes it returned are paid for, so the rate holds however large the
// caller's buffer is. The wrapper hides r's WriterTo, so io.Copy goes through it.
func (l *Limits) Reader(ctx context.Context, tenant string, dir Direction, r io.Reader) io.Reader {
	return &limitedReader{ctx: ctx, l: l, tenant: tenant, dir: dir, r: r}
}

// Writer wraps w so that bytes written through it are paid for, in chunks of at
// most one burst, before each chunk is written. See Reader.
func (l *Limits) Writer(ctx context.Context, tenant string, dir Direction, w io.Writer) io.Writer {
	return &limitedWriter{ctx: ctx, l: l, tenant: tenant, dir: dir, w: w}
}

type limitedReader struct {
	ctx    context.Context
	l      *Limits
	tenant string
	dir    Direction
	r      io.Reader
}

func (lr *limitedReader) Read(p []byte) (int, error) {
	if err := lr.ctx.Err(); err != nil {
		return 0, err
	}
	b, err := lr.l.byteBucket(lr.tenant, lr.dir)
	if err != nil {
		return 0, err
	}
	if b == nil {
		return lr.r.Read(p)
	}
	if len(p) > b.r.Burst {
		p = p[:b.r.Burst]
	}
	n, rerr := lr.r.Read(p)
	if n > 0 {
		// Pay after reading: we only know the size now. The bytes are returned
		// even if the wait is cut short, since they have been consumed from r.
		if werr := b.l.WaitN(lr.ctx, n); werr != nil {
			return n, werr
		}
	}
	return n, rerr
}

type limitedWriter struct {
	ctx    context.Context
	l      *Limits
	tenant string
	dir    Direction
	w      io.Writer
}

func (lw *limitedWriter) Write(p []byte) (int, error) {
	if err := lw.ctx.Err(); err != nil {
		return 0, err
	}
	written := 0
	for len(p) > 0 {
		b, err := lw.l.byteBucket(lw.tenant, lw.dir)
		if err != nil {
			return written, err
		}
		if b == nil {
			n, err := lw.w.Write(p)
			return written + n, err
		}
		chunk := p
		if len(chunk) > b.r.Burst {
			chunk = chunk[:b.r.Burst]
		}
		if err := b.l.WaitN(lw.ctx, len(chunk)); err != nil {
			return written, err
		}
		n, err := lw.w.Write(chunk)
		written += n
		if err != nil {
			return written, err
		}
		if n < len(chunk) {
			return written, io.ErrShortWrite
		}
		p = p[n:]
	}
	return written, nil
}
