package dev.hebrus.flywheel.capture;

import java.io.ByteArrayOutputStream;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.HexFormat;
import java.util.regex.Pattern;

/**
 * Owner, thread and request ids as keyed HMACs, byte for byte as
 * {@code core.privacy.pseudonyms}: {@code kind + hex(HMAC-SHA256(key, tag)[:16])} where
 * {@code tag = "hebrus-flywheel/pseudonym/v1\0" + kind + "\0"} followed by each part as a
 * 4-byte big-endian UTF-8 length and its UTF-8 bytes. Threads and requests are keyed by
 * their raw owner too.
 */
public final class Pseudonyms {
    public static final String OWNER = "o";
    public static final String THREAD = "t";
    public static final String SEQUENCE = "s";
    private static final Pattern PATTERN = Pattern.compile("^[ots][0-9a-f]{32}$");

    private final OwnerKeyStore keys;

    public Pseudonyms(OwnerKeyStore keys) {
        this.keys = keys;
    }

    public String owner(String rawOwner) {
        return make(OWNER, rawOwner);
    }

    public String thread(String rawOwner, String rawThread) {
        return make(THREAD, rawOwner, rawThread);
    }

    public String sequence(String rawOwner, String rawSequenceId) {
        return make(SEQUENCE, rawOwner, rawSequenceId);
    }

    public static boolean isPseudonym(String value, String kind) {
        return value != null && PATTERN.matcher(value).matches() && value.startsWith(kind);
    }

    private String make(String kind, String... parts) {
        ByteArrayOutputStream tag = new ByteArrayOutputStream();
        tag.writeBytes(("hebrus-flywheel/pseudonym/v1\0" + kind + "\0").getBytes(StandardCharsets.UTF_8));
        for (String part : parts) {
            byte[] raw = part.getBytes(StandardCharsets.UTF_8);
            tag.writeBytes(ByteBuffer.allocate(4).putInt(raw.length).array());
            tag.writeBytes(raw);
        }
        byte[] mac = keys.hmac(tag.toByteArray());
        return kind + HexFormat.of().formatHex(mac, 0, 16);
    }
}
