package dev.hebrus.flywheel.capture;

import com.fasterxml.jackson.databind.JsonNode;
import java.io.IOException;
import java.io.InputStream;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Iterator;
import java.util.List;
import org.apache.avro.Schema;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.avro.message.BinaryMessageEncoder;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.header.internals.RecordHeader;

/**
 * The project's {@code schemas/<Name>.v<N>.avsc} files (packed into the jar) and Avro's
 * single-object encoding: {@code C3 01 | CRC-64-AVRO fingerprint of the writer schema's
 * parsing canonical form, 8 bytes little-endian | Avro binary body}, with the Kafka headers
 * {@code schema} (full name), {@code schema-version} (N) and {@code content-type}.
 */
public final class SchemaCatalog {
    public static final String CONTENT_TYPE = "application/vnd.apache.avro.single-object";

    /** One schema version: its parsed schema, encoder, decoder and headers. */
    public static final class Entry {
        public final Schema schema;
        public final int version;
        private final BinaryMessageEncoder<GenericRecord> encoder;
        private final BinaryMessageDecoder<GenericRecord> decoder;
        public final List<Header> headers;

        Entry(Schema schema, int version) {
            this.schema = schema;
            this.version = version;
            this.encoder = new BinaryMessageEncoder<>(GenericData.get(), schema);
            this.decoder = new BinaryMessageDecoder<>(GenericData.get(), schema);
            this.headers = List.of(
                new RecordHeader("schema", schema.getFullName().getBytes(StandardCharsets.UTF_8)),
                new RecordHeader("schema-version",
                    Integer.toString(version).getBytes(StandardCharsets.UTF_8)),
                new RecordHeader("content-type", CONTENT_TYPE.getBytes(StandardCharsets.UTF_8)));
        }

        /** Single-object bytes of a JSON record (field names and values as in the schema). */
        public byte[] encode(JsonNode record) throws IOException {
            GenericRecord datum = (GenericRecord) toAvro(schema, record, schema.getName());
            ByteBuffer buf = encoder.encode(datum);
            byte[] out = new byte[buf.remaining()];
            buf.get(out);
            return out;
        }

        /** A record from single-object bytes written with exactly this schema version. */
        public GenericRecord decode(byte[] value) throws IOException {
            return decoder.decode(value);
        }
    }

    /** Loads {@code schemas/<shortName>.v<version>.avsc} from the class path. */
    public static Entry load(String shortName, int version) throws IOException {
        String path = "/schemas/" + shortName + ".v" + version + ".avsc";
        try (InputStream in = SchemaCatalog.class.getResourceAsStream(path)) {
            if (in == null) {
                throw new IOException("schema " + path + " is not packed in the jar; rebuild it");
            }
            return new Entry(new Schema.Parser().parse(in), version);
        }
    }

    static Object toAvro(Schema schema, JsonNode value, String field) {
        switch (schema.getType()) {
            case RECORD: {
                if (!value.isObject()) {
                    throw bad(field, "an object", value);
                }
                for (Iterator<String> names = value.fieldNames(); names.hasNext(); ) {
                    String name = names.next();
                    if (schema.getField(name) == null) {
                        throw new IllegalArgumentException(schema.getFullName() + " has no field " + name);
                    }
                }
                GenericData.Record out = new GenericData.Record(schema);
                for (Schema.Field f : schema.getFields()) {
                    JsonNode v = value.get(f.name());
                    if (v == null && f.hasDefaultValue()) {
                        out.put(f.pos(), GenericData.get().getDefaultValue(f));
                    } else if (v == null) {
                        throw new IllegalArgumentException(schema.getFullName() + " record is missing " + f.name());
                    } else {
                        out.put(f.pos(), toAvro(f.schema(), v, f.name()));
                    }
                }
                return out;
            }
            case UNION:
                return union(schema, value, field);
            case ENUM:
                if (!value.isTextual() || !schema.hasEnumSymbol(value.asText())) {
                    throw bad(field, "one of " + schema.getEnumSymbols(), value);
                }
                return new GenericData.EnumSymbol(schema, value.asText());
            case ARRAY: {
                if (!value.isArray()) {
                    throw bad(field, "an array", value);
                }
                List<Object> items = new ArrayList<>();
                value.forEach(v -> items.add(toAvro(schema.getElementType(), v, field)));
                return new GenericData.Array<>(schema, items);
            }
            default:
                return primitive(schema, value, field);
        }
    }

    private static Object union(Schema schema, JsonNode value, String field) {
        for (Schema branch : schema.getTypes()) {
            if (branch.getType() == Schema.Type.NULL && value.isNull()) {
                return null;
            }
        }
        for (Schema branch : schema.getTypes()) {
            if (branch.getType() != Schema.Type.NULL) {
                return toAvro(branch, value, field);
            }
        }
        throw bad(field, "null", value);
    }

    private static Object primitive(Schema schema, JsonNode value, String field) {
        switch (schema.getType()) {
            case STRING:
                if (!value.isTextual()) {
                    throw bad(field, "a string", value);
                }
                return value.asText();
            case INT:
                if (!value.isIntegralNumber() || !value.canConvertToInt()) {
                    throw bad(field, "an int", value);
                }
                return value.intValue();
            case LONG:
                if (!value.isIntegralNumber() || !value.canConvertToLong()) {
                    throw bad(field, "a long", value);
                }
                return value.longValue();
            case FLOAT:
                return number(value, field).floatValue();
            case DOUBLE:
                return number(value, field).doubleValue();
            case BOOLEAN:
                if (!value.isBoolean()) {
                    throw bad(field, "a boolean", value);
                }
                return value.booleanValue();
            case BYTES:
                if (!value.isBinary()) {
                    throw bad(field, "bytes", value);
                }
                try {
                    return ByteBuffer.wrap(value.binaryValue());
                } catch (IOException exc) {
                    throw bad(field, "bytes", value);
                }
            default:
                throw new IllegalArgumentException(field + ": Avro type " + schema.getType() + " is not used by capture schemas");
        }
    }

    private static Number number(JsonNode value, String field) {
        if (!value.isNumber()) {
            throw bad(field, "a number", value);
        }
        return value.numberValue();
    }

    private static IllegalArgumentException bad(String field, String expected, JsonNode value) {
        String shown = value.toString();
        return new IllegalArgumentException(field + " must be " + expected + ", got "
            + (shown.length() > 60 ? shown.substring(0, 57) + "..." : shown));
    }
}
