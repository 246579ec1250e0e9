package dev.hebrus.flywheel.capture;

import com.fasterxml.jackson.databind.JsonNode;
import java.io.ByteArrayOutputStream;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.security.GeneralSecurityException;
import java.security.SecureRandom;
import java.util.ArrayList;
import java.util.List;
import javax.crypto.Cipher;
import javax.crypto.spec.GCMParameterSpec;
import javax.crypto.spec.SecretKeySpec;

/**
 * Sealed fields, byte for byte as {@code core.privacy.envelope.seal} and the contexts of
 * {@code streams.sealing}: {@code 0x01 | 12-byte random nonce | AES-256-GCM ciphertext | 16-byte tag}
 * with associated data {@code "hebrus-flywheel/sealed/v1" \0 keyId \0 fieldName \0 context},
 * {@code keyId = "<owner pseudonym>/<generation>"}, and a context of the record's
 * (pseudonymous) fields joined by {@code 0x1F}.
 */
public final class Sealer {
    static final byte SEAL_VERSION = 1;
    private static final SecureRandom RANDOM = new SecureRandom();

    private Sealer() {
    }

    /** Encrypts {@code plaintext} for {@code fieldName} of the record described by {@code context}. */
    public static byte[] seal(OwnerKeyStore.DataKey key, byte[] plaintext, String fieldName, byte[] context) {
        byte[] nonce = new byte[12];
        RANDOM.nextBytes(nonce);
        try {
            Cipher gcm = Cipher.getInstance("AES/GCM/NoPadding");
            gcm.init(Cipher.ENCRYPT_MODE, new SecretKeySpec(key.secret(), "AES"),
                new GCMParameterSpec(128, nonce));
            gcm.updateAAD(aad(key, fieldName, context));
            byte[] body = gcm.doFinal(plaintext);
            return ByteBuffer.allocate(1 + nonce.length + body.length)
                .put(SEAL_VERSION).put(nonce).put(body).array();
        } catch (GeneralSecurityException exc) {
            throw new IllegalStateException("AES-256-GCM is unavailable", exc);
        }
    }

    static byte[] aad(OwnerKeyStore.DataKey key, String fieldName, byte[] context) {
        ByteArrayOutputStream out = new ByteArrayOutputStream();
        out.writeBytes("hebrus-flywheel/sealed/v1".getBytes(StandardCharsets.UTF_8));
        out.write(0);
        out.writeBytes(key.keyId().getBytes(StandardCharsets.UTF_8));
        out.write(0);
        out.writeBytes(fieldName.getBytes(StandardCharsets.UTF_8));
        out.write(0);
        out.writeBytes(context);
        return out.toByteArray();
    }

    /** {@code streams.sealing.turn_context} of a pseudonymized turn. */
    public static byte[] turnContext(JsonNode r) {
        return context("turn", text(r, "thread"), text(r, "generation"), text(r, "sequence_id"),
            text(r, "turn_index"), text(r, "token_offset"));
    }

    /** {@code streams.sealing.observation_context} of a pseudonymized observation. */
    public static byte[] observationContext(JsonNode r) {
        JsonNode spec = r.path("speculative");
        String speculative = spec.isObject()
            ? text(spec, "proposal_id") + "#" + text(spec, "proposal_generation") + "#"
                + text(spec, "candidate_position")
            : "";
        List<String> layers = new ArrayList<>();
        r.path("layers").forEach(l -> layers.add(l.asText()));
        return context("observation", text(r, "thread"), text(r, "generation"),
            text(r, "sequence_id"), text(r, "turn_index"), text(r, "token_ordinal"), speculative,
            text(r, "top_k"), String.join(",", layers));
    }

    private static String text(JsonNode r, String field) {
        JsonNode v = r.path(field);
        if (v.isMissingNode() || v.isNull()) {
            return "";
        }
        if (v.isIntegralNumber()) {
            return v.bigIntegerValue().toString();
        }
        if (v.isTextual()) {
            return v.asText();
        }
        throw new IllegalArgumentException(field + " must be a string or an integer, got " + v);
    }

    private static byte[] context(String... parts) {
        return String.join("\u001f", parts).getBytes(StandardCharsets.UTF_8);
    }

    /** Little-endian int32 bytes of {@code values}. */
    public static byte[] packInt32(long... values) {
        ByteBuffer out = ByteBuffer.allocate(4 * values.length).order(ByteOrder.LITTLE_ENDIAN);
        for (long v : values) {
            if (v < Integer.MIN_VALUE || v > Integer.MAX_VALUE) {
                throw new IllegalArgumentException("token id " + v + " does not fit int32");
            }
            out.putInt((int) v);
        }
        return out.array();
    }
}
