package dev.hebrus.flywheel.capture;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.channels.FileChannel;
import java.nio.charset.StandardCharsets;
import java.nio.file.FileAlreadyExistsException;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.StandardOpenOption;
import java.nio.file.attribute.PosixFilePermission;
import java.nio.file.attribute.PosixFilePermissions;
import java.security.SecureRandom;
import java.util.Base64;
import java.util.HashMap;
import java.util.Map;
import java.util.Set;
import java.util.TreeSet;
import javax.crypto.Mac;
import javax.crypto.spec.SecretKeySpec;

/**
 * The local file owner key store, the same contract as the Python
 * {@code core.privacy.keystore.LocalOwnerKeyStore} (docs/runtime-capture.md, "Key store").
 *
 * <p>Directory {@code $FLYWHEEL_OWNER_KEYS}, else {@code $FLYWHEEL_HOME/keys/owners}
 * ({@code FLYWHEEL_HOME} defaults to {@code ./.flywheel}), mode 0700, holding JSON files of
 * mode 0600 whose {@code format} is {@code hebrus-flywheel-owner-key/v1}:
 * {@code pseudonym-key.json} (the HMAC key), {@code <owner>.json} (the owner's live data key
 * and its generation) and {@code <owner>.erased.json} (tombstone: destroyed generations).
 * A writer creates missing keys (first writer wins: a hard link of a private temporary
 * file); a key whose generation a tombstone lists is never used.
 */
public final class OwnerKeyStore {
    static final String FORMAT = "hebrus-flywheel-owner-key/v1";
    static final String PSEUDONYM_FILE = "pseudonym-key.json";
    private static final ObjectMapper JSON = new ObjectMapper();
    private static final SecureRandom RANDOM = new SecureRandom();
    private static final long MAX_AGE_NANOS = 5_000_000_000L;

    /** One generation of one owner's 256-bit data key. */
    public record DataKey(String owner, long generation, byte[] secret) {
        /** {@code <owner pseudonym>/<generation>}: part of every seal's associated data. */
        public String keyId() {
            return owner + "/" + generation;
        }
    }

    private final Path directory;
    private final byte[] pseudonymKey;
    private final Map<String, Map.Entry<Long, DataKey>> cache = new HashMap<>();

    /** Opens (with {@code create}: creates) the store in {@code directory}. */
    public OwnerKeyStore(Path directory, boolean create) throws IOException {
        this.directory = directory;
        if (create && !Files.isDirectory(directory)) {
            Files.createDirectories(directory,
                PosixFilePermissions.asFileAttribute(PosixFilePermissions.fromString("rwx------")));
        }
        checkPrivate(directory, "directory", "chmod 700");
        Path pseudonym = directory.resolve(PSEUDONYM_FILE);
        if (create && !Files.exists(pseudonym)) {
            ObjectNode body = JSON.createObjectNode();
            body.put("format", FORMAT).put("kind", "pseudonym").put("key", newKey());
            writeFirst(pseudonym, body);
        }
        this.pseudonymKey = secret(read(pseudonym));
    }

    /** The default directory: {@code $FLYWHEEL_OWNER_KEYS}, else {@code $FLYWHEEL_HOME/keys/owners}. */
    public static Path defaultDirectory() {
        String override = System.getenv("FLYWHEEL_OWNER_KEYS");
        if (override != null && !override.isEmpty()) {
            return Paths.get(override);
        }
        String home = System.getenv("FLYWHEEL_HOME");
        Path base = home != null && !home.isEmpty() ? Paths.get(home) : Paths.get(".flywheel");
        return base.toAbsolutePath().resolve("keys").resolve("owners");
    }

    /** HMAC-SHA256 of {@code message} under the pseudonym key (never revealed). */
    public byte[] hmac(byte[] message) {
        try {
            Mac mac = Mac.getInstance("HmacSHA256");
            mac.init(new SecretKeySpec(pseudonymKey, "HmacSHA256"));
            return mac.doFinal(message);
        } catch (java.security.GeneralSecurityException exc) {
            throw new IllegalStateException("HmacSHA256 is unavailable", exc);
        }
    }

    /** The owner's live data key, created (generation = highest destroyed + 1) when none is live. */
    public synchronized DataKey liveKey(String owner) throws IOException {
        Map.Entry<Long, DataKey> cached = cache.get(owner);
        if (cached != null && System.nanoTime() - cached.getKey() < MAX_AGE_NANOS) {
            return cached.getValue();
        }
        DataKey key = load(owner);
        cache.put(owner, Map.entry(System.nanoTime(), key));
        return key;
    }

    /** Generations of the owner's key that an erasure destroyed (its tombstone). */
    public Set<Long> destroyedGenerations(String owner) throws IOException {
        Set<Long> out = new TreeSet<>();
        Path tombstone = directory.resolve(owner + ".erased.json");
        if (Files.exists(tombstone)) {
            for (JsonNode g : read(tombstone).path("generations")) {
                out.add(g.asLong());
            }
        }
        return out;
    }

    private DataKey load(String owner) throws IOException {
        if (!Pseudonyms.isPseudonym(owner, Pseudonyms.OWNER)) {
            throw new IllegalArgumentException("owner must be an owner pseudonym, got " + owner);
        }
        Set<Long> destroyed = destroyedGenerations(owner);
        Path path = directory.resolve(owner + ".json");
        if (!Files.exists(path)) {
            long fresh = destroyed.stream().mapToLong(Long::longValue).max().orElse(-1L) + 1;
            ObjectNode body = JSON.createObjectNode();
            body.put("format", FORMAT).put("kind", "data").put("owner", owner)
                .put("generation", fresh).put("key", newKey());
            writeFirst(path, body);
        }
        JsonNode body = read(path);
        DataKey key = new DataKey(owner, body.path("generation").asLong(), secret(body));
        if (destroyed.contains(key.generation())) {
            shred(path);  // an erasure that stopped half-way: finish it, as the Python store does
            throw new IllegalStateException("owner " + owner + "'s data key (generation "
                + key.generation() + ") was destroyed by an erasure");
        }
        return key;
    }

    private static String newKey() {
        byte[] raw = new byte[32];
        RANDOM.nextBytes(raw);
        return Base64.getEncoder().encodeToString(raw);
    }

    /** Writes {@code body} to {@code path} (0600) unless another writer got there first. */
    private void writeFirst(Path path, ObjectNode body) throws IOException {
        Path tmp = directory.resolve("." + path.getFileName() + "." + ProcessHandle.current().pid()
            + "." + System.nanoTime() + ".tmp");
        Files.createFile(tmp,
            PosixFilePermissions.asFileAttribute(PosixFilePermissions.fromString("rw-------")));
        try {
            try (FileChannel ch = FileChannel.open(tmp, StandardOpenOption.WRITE)) {
                ch.write(ByteBuffer.wrap(JSON.writeValueAsBytes(body)));
                ch.force(true);
            }
            try {
                Files.createLink(path, tmp);
            } catch (FileAlreadyExistsException exc) {
                // another writer created it first: theirs is the key
            }
        } finally {
            Files.deleteIfExists(tmp);
        }
    }

    private static void shred(Path path) throws IOException {
        try (FileChannel ch = FileChannel.open(path, StandardOpenOption.WRITE)) {
            ch.write(ByteBuffer.allocate((int) ch.size()));
            ch.force(true);
        } catch (NoSuchFileException exc) {
            return;
        }
        Files.deleteIfExists(path);
    }

    private JsonNode read(Path path) throws IOException {
        checkPrivate(path, "file", "chmod 600");
        JsonNode body;
        try {
            body = JSON.readTree(new String(Files.readAllBytes(path), StandardCharsets.UTF_8));
        } catch (NoSuchFileException exc) {
            throw new IOException("the key store file " + path + " is missing", exc);
        }
        if (body == null || !FORMAT.equals(body.path("format").asText())) {
            throw new IOException("the key store file " + path + " is not a " + FORMAT + " file");
        }
        return body;
    }

    private static byte[] secret(JsonNode body) throws IOException {
        byte[] key = Base64.getDecoder().decode(body.path("key").asText(""));
        if (key.length != 32) {
            throw new IOException("a key store file holds a " + key.length * 8 + "-bit key, not 256");
        }
        return key;
    }

    private static void checkPrivate(Path path, String what, String fix) throws IOException {
        Set<PosixFilePermission> perms;
        try {
            perms = Files.getPosixFilePermissions(path);
        } catch (NoSuchFileException exc) {
            throw new IOException("no owner key store " + what + " at " + path
                + ": run a writer (create) or point $FLYWHEEL_OWNER_KEYS at the store", exc);
        }
        for (PosixFilePermission p : perms) {
            if (!p.name().startsWith("OWNER_")) {
                throw new IOException("the key store " + what + " " + path
                    + " is readable by others; it must be private: " + fix + " " + path);
            }
        }
    }
}
